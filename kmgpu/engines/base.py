"""The one interface every engine implements, and the in-process engine shared by
TensorFlow and JAX.

An engine answers *how replicas are made and synchronised* on one backend. It
never decides batch sizes or learning rates (that is ``plan.py``) and never
starts processes by itself unless its backend needs them (torch).

The contract every engine keeps: ``fit`` / ``evaluate`` / ``predict`` and the
``*_on_batch`` methods run on ``num_replicas`` devices with Keras's own trainer,
take the user's ``template`` model as the source of truth for weights and compile
settings before each call (copying in only what changed since the last one), and
after ``fit`` and ``train_on_batch`` -- also when interrupted -- leave the trained
weights and the optimizer state in ``template``.
"""

import abc
import contextlib
import dataclasses
from typing import Optional

from kmgpu.engines import replication


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's configuration: ``parallelize``'s options and the devices ``gpus=`` chose.

    Built once, by the front (``kmgpu.connector.connect``), as Lightning Fabric's
    connector builds one strategy from one config; the engine gets it, and on torch the
    launcher hands the same record to every rank's strategy (``DDPStrategy(device,
    config)``: pickled to a pool worker, as it is under torchrun). Plain values only, so
    it pickles anywhere; nothing reaches back to the front for them.
    """

    #: indices into the backend's devices (its ``runtime.physical_devices()``), main first
    device_ids: tuple = ()
    #: (kind, index) of each of those devices, e.g. (("gpu", 0), ("gpu", 2))
    devices: tuple = ()
    #: "global": fit's batch_size is the global batch; "per_replica": per device
    batch: str = "global"
    #: the learning rate times N (linear scaling rule), ramped over ``warmup_epochs``
    scale_lr: bool = False
    warmup_epochs: int = 0
    #: BatchNormalization moments over the global batch (else each replica's own)
    sync_batchnorm: bool = False
    #: stateful RNNs: "epoch" zeroes their states each epoch and evaluate/predict; None never
    reset_states: Optional[str] = "epoch"
    #: stateful RNNs: drop the samples after the last whole batch
    drop_remainder: bool = False
    #: laid out over the devices, 1/N on each: None, "optimizer" (ZeRO-1), "gradients"
    #: (ZeRO-2: and the gradients) or "weights" (ZeRO-3 / FSDP: and the weights)
    shard: Optional[str] = None
    #: torch on CUDA: float32 matmuls in TF32 inside kmgpu's steps (``torch/precision.py``)
    tf32: bool = True

    @property
    def shard_optimizer(self):
        """The optimizer state is 1/N per device: every ``shard`` value shards it."""
        return self.shard is not None

    @property
    def device_names(self):
        """The devices as "kind:index" strings, main first."""
        return [f"{kind}:{index}" for kind, index in self.devices]


class Engine(abc.ABC):
    """Base class: one per backend.

    Args:
        config: the run's ``Config`` (its devices and options).
    """

    #: what does the work, in words, for describe()
    name = "?"
    #: whether stateful RNN models train with per-replica state rows here
    supports_stateful = False
    #: the one-device engine when ``plain_fit_serves`` (None: ``local.LocalEngine``)
    local_engine = None
    #: the ``shard`` values this engine lays out over its devices, and why it has none
    shards = ()
    no_sharding = "this engine keeps a whole copy of everything on every device"

    def __init__(self, config):
        self.config = config
        self.device_ids = list(config.device_ids)
        self.device_names = config.device_names

    @property
    def num_replicas(self):
        return len(self.device_ids)

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        """True when the user's own ``model.fit`` on the default device is exactly what
        this engine would do with these devices (one device, nothing to add)."""
        return False

    @abc.abstractmethod
    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        """Run ``template.<method>(**kwargs)`` on the replicas.

        Args:
            method: "fit", "evaluate", "predict", "train_on_batch", "test_on_batch"
                or "predict_on_batch".
            template: the user's own built (and, for fit/evaluate/train_on_batch/
                test_on_batch, compiled) model.
            kwargs: Keras keyword arguments, batch sizes already global; for fit,
                ``callbacks`` already holds kmgpu's learning-rate callbacks.
            lr_scale: (factor, warmup_steps) for a LearningRateSchedule optimizer:
                pass it to ``replication.compile_args``.

        Returns:
            What Keras returns: a History, a loss/metrics list or dict, or predictions.
        """

    def train_step_mode(self, template):
        """How each replica's train step runs, for describe() (None: say nothing)."""
        return None

    def sharded_bytes(self, template, kind):
        """What ``shard`` lays out of ``kind`` ("weights", "gradients" or "optimizer"),
        for describe(): (bytes on the fullest device, whole bytes, bytes kept whole on
        every device) measured where this engine shards it; None to let describe()
        say whole / N (or whole, where ``shard`` does not cover ``kind``)."""
        return None

    def batchnorm_mode(self):
        """How BatchNormalization statistics are computed, for describe()."""
        if self.num_replicas == 1:
            return "one device"
        return "global batch (synchronised)" if self.config.sync_batchnorm else "per replica"

    def close(self):
        """Free what the engine holds (processes, device memory)."""


class InProcessEngine(Engine):
    """Replicas inside this process, under a backend scope (TF strategy, JAX distribution).

    Keeps one replica model, created inside ``scope()`` from the template's config
    (a variable's placement is fixed when it is created), and copies weights and
    optimizer state template -> replica before each call (where they differ:
    ``same_values``) and back after fit and train_on_batch.
    The replica and its optimizer live across calls so optimizer state carries over.

    Stateful RNN states travel the same way, before and after every call: the
    template holds all B rows; ``read_states`` / ``write_states`` map them to
    where the backend keeps each replica's rows.
    """

    supports_stateful = True

    def __init__(self, config):
        super().__init__(config)
        self.replica = None
        self._built_from = None  # (config json, id of the template's optimizer)
        self.copied_in = None  # variables the last call copied into the replica

    @abc.abstractmethod
    def scope(self):
        """Context manager under which the replica is created, compiled and run."""

    def call_context(self, method):
        """Extra context around a fit/evaluate/predict call (default: none)."""
        return contextlib.nullcontext()

    def prepare_replica(self, replica, template):
        """Hook: adjust a freshly cloned replica before it is compiled (sync BatchNorm,
        custom steps): ``replication.make_replica``'s ``prepare``."""

    def replica_batch(self, global_batch):
        """The batch a stateful replica model is built for (default: the global batch)."""
        return global_batch

    def read_states(self, replica):
        """The replica's stateful RNN states as arrays of all B rows, replica 0's first."""
        import keras

        return [keras.ops.convert_to_numpy(v.value) for v in replication.state_variables(replica)]

    def write_states(self, replica, arrays):
        """Set the replica's stateful RNN states from arrays of all B rows."""
        for v, a in zip(replication.state_variables(replica), arrays):
            v.assign(a)

    def same_values(self, pairs):
        """Which (template variable, replica variable) pairs hold the same value already,
        so that copying the template in would change nothing there.

        Must be sound: True only when it is certain. The default knows nothing (every
        call copies the whole state in); an engine answers cheaply from what its
        backend guarantees (``note_synced`` marks the state it last made equal).

        Returns:
            One bool per pair.
        """
        return [False] * len(pairs)

    def note_synced(self, pairs):
        """Hook: every pair holds the same value now (just copied, either way)."""

    def copy_back(self, pairs):
        """Copy each (replica variable, template variable) pair's value to the template
        (default: through NumPy, one variable at a time)."""
        for r, t in pairs:
            t.assign(keras_numpy(r.value))

    def settle(self, replica):
        """Hook after every call, also one that raised: leave the replica's variables
        holding their values (default: nothing to do)."""

    def run_on_batch(self, replica, method, kwargs):
        """``replica.<method>(**kwargs)`` for the ``*_on_batch`` methods (an engine may
        place the batch first, e.g. split it over its replicas)."""
        return getattr(replica, method)(**kwargs)

    def _ensure_replica(self, template, lr_scale):
        key = (replication.identity(template), lr_scale)
        if self.replica is None or key != self._built_from:
            self.replica, self._built_from = None, None
            with self.scope():
                replica = replication.make_replica(
                    template, rows=self.replica_batch, lr_scale=lr_scale,
                    prepare=lambda replica: self.prepare_replica(replica, template))
            self.replica, self._built_from = replica, key
        return self.replica

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        """One call on the replica. The template's state is copied in where it differs
        from the replica's (``same_values``): the replica stays resident, so a loop of
        calls on an unchanged model copies nothing in; after ``fit`` and
        ``train_on_batch`` (also when they raise) the trained state is copied back."""
        import keras

        replica = self._ensure_replica(template, lr_scale)
        on_batch = method in ON_BATCH
        states = replication.state_variables(template)
        if states and self.config.reset_states == "epoch" and not on_batch:
            replication.reset_states(template)
            if method == "fit":
                kwargs = dict(kwargs, callbacks=[replication.reset_callback(replica)]
                              + list(kwargs.get("callbacks") or []))
        with self.scope():
            pairs = replication.state_pairs(template, replica)
            skip = self.same_values(pairs)
            self.copied_in = skip.count(False)  # for tests and benchmarks
            replication.copy_state(template, replica, pairs, skip=skip)
            self.note_synced(pairs)
            if method == "train_on_batch":  # fit sets it from its callbacks
                replication.copy_lr(template, replica)
            if states:
                self.write_states(replica, [keras.ops.convert_to_numpy(v.value) for v in states])
        try:
            with self.scope(), self.call_context(method):
                if on_batch:
                    result = self.run_on_batch(replica, method, kwargs)
                else:
                    result = getattr(replica, method)(**kwargs)
        finally:
            self.settle(replica)
            if method in TRAINING:
                back = replication.state_pairs(replica, template)
                self.copy_back(back)
                self.note_synced([(t, r) for r, t in back])
            for v, a in zip(states, self.read_states(replica) if states else ()):
                v.assign(a)
        if method == "fit":
            template.history = result
        return result


def keras_numpy(value):
    import keras

    return keras.ops.convert_to_numpy(value)


#: the methods that run one batch (``keras.Model.train_on_batch`` etc.)
ON_BATCH = ("train_on_batch", "test_on_batch", "predict_on_batch")
#: the methods after which the replica's trained state goes back to the template
TRAINING = ("fit", "train_on_batch")

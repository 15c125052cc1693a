"""What each torch rank runs: DistributedDataParallel inside Keras's own ``fit``.

``DDPStrategy`` is one rank of an initialised ``torch.distributed`` group, in a pool
worker or in a process torchrun started (the launchers decide which; nothing here
starts processes). It turns a compiled Keras model into this rank's replica
(``prepare``) and runs one call on this rank's share of the data (``run``).

How one global batch becomes N equal steps: every rank feeds Keras the same number
of batches (``inputs.RankSlices``). The step (``train_step``, the documented Keras
extension point) runs the forward pass through ``DistributedDataParallel`` and
weighs the rank's loss by its part of the global batch's loss before ``backward``
(``kmgpu.engines.loss_fixes.replica_loss``: ``n_local / n_global`` for a mean); DDP's
buckets are summed (not averaged) by a comm hook, so the update equals the
one-device update of the global batch, also for a partial last batch. Keras's loss
tracker is updated with the rank's value (``tracker_update``) and row count, and at
the end of every epoch and evaluation the metric variables (Keras keeps additive totals and counts)
are summed over ranks before Keras reads them. BatchNormalization moving statistics
are averaged over ranks after every step (weighted by batch share), or with
``sync_batchnorm`` the moments are computed over the global batch.
"""

import contextlib

import keras
import numpy as np
import torch
import torch.distributed as dist

from kmgpu.engines import replication
from kmgpu.engines import batch_checks
from kmgpu.engines.base import ON_BATCH
from kmgpu.engines.torch import collectives, data_fixes, layer_fixes, step_fixes
from kmgpu.engines.torch.data import inputs, resident
from kmgpu.engines.torch.launch import checkpoint_io
from kmgpu.engines.torch.launch.messages import Aborted, Predictions
from kmgpu.engines.torch.launch.relay import Abort, SyncCallback
from kmgpu.engines.torch.optim import placement
from kmgpu.engines.torch.steps import ddp as ddp_module
from kmgpu.engines.torch.steps.rank_steps import RankSteps


class DDPStrategy:
    """This rank's place in the group and what its replica's steps share; one per replica.

    Args:
        device: the torch device the replica and the collectives live on.
        config: the run's ``kmgpu.engines.base.Config``, the same record on every rank
            whichever launcher started it (its ``sync_batchnorm``, ``shard_optimizer``
            and ``tf32`` shape the steps ``prepare`` installs).
        gather_everywhere: a sharded optimizer state is gathered on every rank (each
            torchrun process's own model gets it), not on rank 0 only (a pool's driver
            reads rank 0's).
    """

    def __init__(self, device, config, gather_everywhere=False):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(device)
        self.config = config
        self.gather_everywhere = gather_everywhere
        self.steps = RankSteps(self)  # the steps ``prepare`` installs
        self.sharded_step = None  # the prepared replica's SplitStep, its optimizer state sharded
        self.train = None        # the RankSlices feeding the current fit
        self.test = None         # ... the current evaluate (also fit's validation)
        self.collective = False  # metric variables are summed over ranks when read
        self.last_rows = None    # real rows of this rank's share of the last *_on_batch

    # -- state across ranks -------------------------------------------------------------
    @property
    def host_built(self):
        """shard="weights" over several ranks: the replica is built in host memory and
        only this rank's pieces of its weights and optimizer state reach the device
        (``building``, ``prepare``), so no rank's device ever holds them whole."""
        return self.config.shard == "weights" and self.world > 1

    def building(self):
        """The scope a replica is made in (``replication.make_replica``, ``prepare``
        inside it): host memory when ``host_built``, else the rank's device (the
        worker's or the caller's own scope)."""
        return keras.device("cpu") if self.host_built else contextlib.nullcontext()

    def _weight_shards(self):
        """The replica's ``zero.Shards`` when it shards the weights, else None."""
        step = self.sharded_step
        zero = step.zero if step is not None else None
        return zero if zero is not None and zero.weights else None

    @property
    def pieces_out(self):
        """A pool rank's shard="weights" state goes out as pieces: each rank writes its
        own into the snapshots (``replicas.write_pieces``), so it is never gathered
        whole into rank 0 (under torchrun, ``gather_everywhere``, each process's own
        model gets it whole)."""
        return self._weight_shards() is not None and not self.gather_everywhere

    def receivable(self):
        """Before a state is loaded into the replica's variables (``receive_state``, or
        the launcher's copy under torchrun): a sharded optimizer state's Keras slot
        variables whole again (between calls they hold nothing, ``let_go``), with
        sharded weights host buffers for the weights too (local: no collective);
        nothing when the state is not sharded."""
        step = self.sharded_step
        if step is not None and step.zero is not None:
            step.zero.receivable()

    def receive_state(self, replica, load=None, shared=True):
        """Rank 0's state in every rank's replica.

        Args:
            load: ``load(replica)`` sets the replica's state (None: it was set after
                ``receivable``).
            shared: every rank's ``load`` gives rank 0's state (a pool's state file):
                with sharded weights every rank loads it into host memory and keeps
                its pieces, with no collective; else rank 0 loads it and broadcasts
                it. Not shared (torchrun: each process's own model): every rank loads,
                and rank 0's wins: broadcast, or with sharded weights sent piece by
                piece, each rank its own (``zero.Shards.take``).
        """
        placement.receive(self, replica, load, shared)

    def broadcast_state(self, replica):
        """Rank 0's weights and optimizer state on every rank (identical start, not seeding)."""
        opt = getattr(replica, "optimizer", None)
        if opt is not None and not opt.built:
            opt.build(replica.trainable_variables)
        self.receivable()  # a sharded state: whole Keras slot variables to receive into
        variables = list(replica.weights)
        if opt is not None and opt.built:
            variables += list(opt.variables)
        collectives.broadcast_tensors([v.value for v in variables], self.device)

    def held_bytes(self):
        """Bytes this rank's train step holds now by kind (``SplitStep.held_bytes``;
        None without kmgpu's split step), and on a GPU "device_peak": the most memory
        this rank's process has had allocated there (``torch.cuda.max_memory_allocated``:
        weights, gradients, optimizer state, activations and temporaries together)."""
        step = self.sharded_step
        held = step.held_bytes() if step is not None else None
        if self.device.type == "cuda":
            held = dict(held or {}, device_peak=torch.cuda.max_memory_allocated(self.device))
        return held

    def _gather_optimizer_state(self):
        """A sharded optimizer state whole in rank 0's Keras variables (with
        ``gather_everywhere``, every rank's); nothing when it is not sharded or goes
        out as pieces (``pieces_out``)."""
        if self.pieces_out:
            return
        if self.sharded_step is not None and self.sharded_step.zero is not None:
            self.sharded_step.zero.materialize(self.gather_everywhere)

    def let_go(self):
        """After a fit or train_on_batch whose state rank 0 has written out (a pool
        worker, every rank alike: no collective), with
        any ``shard``: the whole optimizer state (and weights) that the
        last gather put into rank 0's Keras variables freed again, so between calls no
        rank holds a whole copy. Under torchrun each process's own model is filled from
        its replica after the call: it keeps them until its next step."""
        step = self.sharded_step
        if step is None or step.zero is None or self.gather_everywhere:
            return
        step.zero.release()

    def write_state_rows(self, replica, arrays):
        """Set this rank's rows of the replica's stateful RNN states.

        The replica is built for B/N rows; rank r owns rows r*B/N ... (r+1)*B/N - 1,
        the rows of every global batch ``RankSlices`` gives it.

        Args:
            replica: this rank's replica.
            arrays: the template's states, all B rows each.
        """
        for v, a in zip(replication.state_variables(replica), arrays):
            b = int(v.shape[0])
            v.assign(np.asarray(a)[self.rank * b:(self.rank + 1) * b])

    @staticmethod
    def state_rows(replica):
        """This rank's stateful RNN state rows, as arrays (empty list: none)."""
        return [keras.ops.convert_to_numpy(v.value) for v in replication.state_variables(replica)]

    # -- the replica --------------------------------------------------------------------
    def prepare(self, replica):
        """Turn a built, compiled Keras model into this rank's replica (in place).

        Installs the distributed train/test steps, sync BatchNorm, the metric
        reduction and the evaluate wrapper as instance attributes; the model's class
        and weights are untouched. A ``host_built`` replica (made in host memory) has
        its weights and optimizer state cut into pieces now, only this rank's pieces
        copied to the device, and everything else moved there (``placement``).

        Returns:
            ``replica``.
        """
        if not self.host_built:
            return self._prepare(replica)
        with keras.device(str(self.device)):  # what the steps make: on the device
            replica = self._prepare(replica)
        placement.onto_device(self, replica)
        return replica

    def _prepare(self, replica):
        bn_layers = [layer for layer in replica._flatten_layers()
                     if isinstance(layer, keras.layers.BatchNormalization)]
        averaged = []
        if self.config.sync_batchnorm:
            for layer in bn_layers:
                layer_fixes.global_batch_moments(
                    layer, collectives.SumOverRanks.apply, self.steps.train_rows,
                    self.rank, self.world)
        else:
            averaged = [v for layer in bn_layers for v in layer.non_trainable_weights
                        if "float" in str(v.dtype)]
        self._offset_seeds(replica)
        for layer in replication.stateful_layers(replica):
            layer_fixes.copy_states_in(layer)
        from kmgpu.engines.torch.capture import eval_steps, graphs

        # graphs.choose_step: the captured step on CUDA devices (the same on every rank: one
        # device type), Keras's step on a CPU unless jit_compile=True, run_eagerly=True off
        kind, why = graphs.choose_step(replica, graphs.available(self.device))
        evals = eval_steps.rank_kinds(replica, self.device)  # captured evaluate / predict
        self.sharded_step = None
        if self.config.shard_optimizer and self.world > 1:  # ZeRO-1 lives in the split step
            if kind == graphs.KERAS and replica.trainable_weights and replica.compiled:
                kind = graphs.SPLIT
            elif kind != graphs.SPLIT and self.rank == 0:
                print(f"kmgpu (torch): shard={self.config.shard!r}: nothing is sharded, the "
                      f"weights, gradients and optimizer state stay whole on every rank: {why}")
        if (kind == graphs.KERAS and self.world > 1 and replica.compiled
                and getattr(replica, "loss", None) is None and replica.trainable_weights):
            # only added losses: DDP finds unused weights from the forward's outputs,
            # which no loss reads, and fails at the second step; the split step sums
            # one flat gradient buffer after backward instead
            kind = graphs.SPLIT
        replica.jit_compile = False  # the step holds collectives; torch.compile stays out
        if kind == graphs.SPLIT:
            captured, self.sharded_step = self.steps.captured_step(replica, averaged)
            replica.train_step = captured.train_step
        elif kind == graphs.KERAS and replica.trainable_weights:
            ddp = ddp_module.wrap(replica, self.device)
            replica.train_step = self.steps.keras_step(replica, ddp, averaged)
        else:
            if kind == graphs.OWN and self.rank == 0 and graphs.available(self.device):
                print(f"kmgpu (torch): the train step runs eagerly, not captured: {why}")
            self.steps.hook_own_steps(replica, averaged)
        if not step_fixes.has_own_test_step(replica):
            replica.test_step = self.steps.test_step(replica)
        self.evals = eval_steps.capture_on_rank(self, replica, evals)
        if self.sharded_step is not None and self.sharded_step.shard == "weights":
            self._gather_weights_in(replica)
        step_fixes.read_logs_within(replica, lambda: self.steps.summed_metrics(replica))
        replica.evaluate = self._evaluate(replica)
        return replica

    def _gather_weights_in(self, replica):
        """shard="weights": the test and predict steps and Keras's symbolic build (it calls
        the model: ``step_fixes.build_within``) gather the layers where used, as training does."""
        split = self.sharded_step

        def gathered(key):  # (whole before the first train step shards them)
            return (split.zero.active(key) if split.zero is not None
                    else contextlib.nullcontext())

        for name in ("test_step", "predict_step"):
            inner = getattr(replica, name)

            def step(batch, inner=inner, name=name):
                with gathered(name):
                    return inner(batch)

            setattr(replica, name, step)
        step_fixes.build_within(replica, lambda: gathered("build"))

    def _offset_seeds(self, replica):
        """Per-rank random streams (dropout etc.): each rank's SeedGenerators start apart."""
        if self.rank == 0:
            return
        for layer in replica._flatten_layers():
            for generator in getattr(layer, "_seed_generators", []) or []:
                state = np.asarray(generator.state.numpy()).astype(np.int64)
                state[0] = (state[0] + 1_000_003 * self.rank) % 2**32
                generator.state.assign(state.astype(generator.state.dtype))

    def _evaluate(self, replica):
        evaluate = step_fixes.keras_evaluate(replica)

        def evaluate_(x=None, *args, **kwargs):
            mine = isinstance(x, inputs.RankSlices)
            if mine and kwargs.get("_use_cached_eval_dataset"):
                x.next_pass()  # fit's validation: the next pass of data read for the ranks
            saved = self.test, self.collective
            self.test, self.collective = (x, True) if mine else (None, False)
            try:
                return evaluate(x, *args, **kwargs)
            finally:
                self.test, self.collective = saved

        return evaluate_

    # -- one call -----------------------------------------------------------------------
    def run(self, replica, method, kwargs, *, hooks=(), relay=None, snapshot=None,
            reload=None, reset_states=False, fit_callbacks=()):
        """Run ``replica.<method>`` on this rank's share of the data.

        Args:
            replica: a model made by ``prepare``, with rank 0's state already broadcast.
            method: "fit", "evaluate" or "predict".
            kwargs: Keras's keyword arguments with full (global) data and batch sizes,
                without ``callbacks`` (those run where ``relay`` sends the hooks).
            hooks: the hooks the user's callbacks implement (the same on every rank).
            relay: on rank 0, ``relay(Event) -> Reply`` runs them.
            snapshot: on rank 0 (on every rank where the state goes out as pieces,
                ``pieces_out``), ``snapshot(replica, epoch)`` at every epoch end and
                with epoch -1 at the end of training (it decides whether to save).
            reload: in a pool worker, ``reload(replica)`` loads the state the driver
                wrote after its callbacks changed the model (every rank can: see
                ``receive_state``); None under torchrun, where rank 0's replica has it
                (``receivable``, then the launcher's copy).
            fit_callbacks: more Keras callbacks every rank runs in fit (the launcher's:
                the next pass of data read for the ranks, a stop request); one that
                raises ``relay.Abort`` ends the call on every rank at that point.
            reset_states: zero the stateful RNN states now and, in fit, at the start
                of every epoch.

        Returns:
            ``Aborted()`` if a user callback raised; else fit: None (the History is
            kept where the user's callbacks run); evaluate: Keras's return value
            (metrics summed over ranks); predict: this rank's ``Predictions`` with
            stand-in rows dropped.
        """
        kwargs = dict(kwargs)
        if method in ON_BATCH:
            return self._on_batch(replica, method, kwargs)
        kwargs.pop("callbacks", None)
        verbose = kwargs.pop("verbose", "auto") if self.rank == 0 else 0
        kwargs.pop("verbose", None)
        replica.stop_training = False

        def reload_everywhere(model):  # the driver's callbacks changed the model
            self.receive_state(model, reload, shared=reload is not None)

        def checkpoint(model, request):  # a ShardedCheckpoint's save or restore
            checkpoint_io.carry_out(self, model, request, shared=reload is not None)

        sync = SyncCallback(self.rank, self.device, hooks, relay,
                            snapshot if method == "fit" else None, reload_everywhere,
                            batch_logs=replica._get_metrics_result_or_logs,
                            checkpoint=checkpoint)
        callbacks = [sync] + (list(fit_callbacks) if method == "fit" else [])
        if method == "fit" and self.sharded_step is not None and not self.pieces_out:
            # whole, before sync's snapshots
            from kmgpu.engines.torch.optim import zero

            callbacks.insert(0, zero.GatherOptimizerState(self.sharded_step,
                                                          self.gather_everywhere))
        if reset_states:
            replication.reset_states(replica)
            callbacks.insert(0, replication.reset_callback(replica))
        guard = batch_checks.guard(replica, method, self.world)  # each batch of a dataset
        try:
            if method == "fit":
                return self._fit(replica, kwargs, verbose, callbacks, guard)
            if method == "evaluate":
                slices = inputs.RankSlices(
                    inputs.source_of(kwargs.pop("x"), kwargs.pop("y", None),
                                   kwargs.pop("sample_weight", None), guard, "the data"),
                    kwargs.pop("batch_size"), self.rank, self.world)
                return replica.evaluate(x=slices, verbose=verbose, callbacks=[sync], **kwargs)
            if method == "predict":
                return self._predict(replica, kwargs, verbose, sync)
        except (Abort, batch_checks.BatchRefused) as e:
            # every rank at the same point (a refused batch: each rank read the same
            # global batch): the sharded state can be gathered
            self._gather_optimizer_state()
            return Aborted(e if isinstance(e, batch_checks.BatchRefused) else None)
        raise ValueError(method)

    def _on_batch(self, replica, method, kwargs):
        """``train_on_batch`` / ``test_on_batch`` / ``predict_on_batch`` on this rank's
        contiguous rows of the one batch (``RankSlices`` of one global batch: a stand-in
        row of weight 0 where the share is empty). Train and test return Keras's logs
        with the metrics summed over ranks; predict this rank's ``Predictions``."""
        x, y, sw = kwargs.pop("x"), kwargs.pop("y", None), kwargs.pop("sample_weight", None)
        n = inputs.num_rows(x)
        slices = inputs.RankSlices(inputs.source_of(x, y, sw), n, self.rank, self.world)
        batch = slices[0]
        n_real = self.last_rows = slices.current[0]
        if method == "predict_on_batch":
            out = replica.predict_on_batch(batch[0])
            lo, _ = inputs.split(n, self.world, self.rank)
            return Predictions(np.arange(lo, lo + n_real), keras.tree.map_structure(
                lambda a: np.asarray(a)[:n_real], out))
        part = "train" if method == "train_on_batch" else "test"
        saved = getattr(self, part), self.collective
        setattr(self, part, slices)
        self.collective = True
        try:
            getattr(replica, method)(*batch, return_dict=True)
            self._gather_optimizer_state()  # for the snapshot
            with self.steps.summed_metrics(replica):
                logs = step_fixes.pythonify_logs(replica.get_metrics_result())
        finally:
            setattr(self, part, saved[0])
            self.collective = saved[1]
        return logs if kwargs.get("return_dict") else replica._flatten_metrics_in_order(logs)

    def _predict(self, replica, kwargs, verbose, sync):
        x = kwargs.pop("x")
        batch_size = kwargs.pop("batch_size")
        slices = inputs.RankSlices(inputs.source_of(x), batch_size, self.rank, self.world)
        steps = min(kwargs.get("steps") or len(slices), len(slices))
        out = replica.predict(x=slices, verbose=verbose, callbacks=[sync], **kwargs)
        if inputs.is_dataset(x):
            keep, where = inputs.dataset_positions(slices, steps)
        else:
            keep, where = inputs.predict_positions(inputs.num_rows(x), batch_size, self.world,
                                                 self.rank, steps)
        return Predictions(where, keras.tree.map_structure(lambda a: np.asarray(a)[keep], out))

    def _fit(self, replica, kwargs, verbose, callbacks, guard=None):
        x, y, sw = kwargs.pop("x"), kwargs.pop("y", None), kwargs.pop("sample_weight", None)
        batch_size = kwargs.pop("batch_size")
        validation_data = kwargs.pop("validation_data", None)
        validation_split = kwargs.pop("validation_split", 0.0)
        validation_batch_size = kwargs.pop("validation_batch_size", None) or batch_size
        shuffle = kwargs.pop("shuffle", True)
        if validation_split and validation_data is None:
            if inputs.is_dataset(x):
                raise ValueError("validation_split needs arrays, not a PyDataset: pass "
                                 "validation_data instead.")
            (x, y, sw), validation_data = data_fixes.train_validation_split(
                (x, y, sw), validation_split)
        source = inputs.source_of(x, y, sw, guard, "the training data")
        train = inputs.RankSlices(resident.on_device(source, self.device), batch_size, self.rank,
                                  self.world, shuffle=shuffle)
        val = None
        if validation_data is not None:
            if inputs.is_dataset(validation_data):
                vsource = inputs.DatasetSource(validation_data, guard, "the validation data")
            else:
                vsource = inputs.ArraySource(*keras.utils.unpack_x_y_sample_weight(
                    validation_data))
                validation_batch_size = validation_batch_size or inputs.keras_batch_size(
                    vsource.n, kwargs.get("validation_steps"))
            val = inputs.RankSlices(vsource, validation_batch_size, self.rank, self.world)
        self.train, self.collective = train, True
        try:
            replica.fit(x=train, validation_data=val, shuffle=False, verbose=verbose,
                        callbacks=callbacks, **kwargs)
        finally:
            self.train, self.collective = None, False
        return None  # the History is kept where the callbacks run

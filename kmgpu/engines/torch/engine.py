"""Torch engine: ``DistributedDataParallel`` inside Keras's own ``fit``.

Keras 3.15 has no DDP in its torch trainer, so every rank runs Keras's ``fit`` /
``evaluate`` / ``predict`` on a replica whose ``train_step`` (the documented
extension point) runs the forward pass through DDP and weights the loss by the
rank's share of the global batch (``strategy``).

Where the ranks run is the launcher's business (``launchers``): kmgpu's own pool of
worker processes, or this process itself when torchrun (or ``kmgpu launch``)
started it as one rank. Every call goes the same way whichever it is: the ranks
get the template's state, rank 0 relays the user's callbacks' hooks to a
``relay.CallbackDriver`` here, and the trained state, the stateful RNN rows and the
result come back to the user's model.
"""


from kmgpu.engines import replication
from kmgpu.engines import batch_checks
from kmgpu.engines.base import Engine
from kmgpu.engines.local import LocalEngine
from kmgpu.engines.torch import capture_fixes, replicas
from kmgpu.engines.torch.capture import eval_steps, graphs
from kmgpu.engines.torch.data import feeds, inputs, resident, shuffle
from kmgpu.engines.torch.fast import layers as fast_layers
from kmgpu.engines.torch.launch import launchers, relay, timing
from kmgpu.engines.torch.launch.messages import Aborted, Call
from kmgpu.engines.torch.optim import held, sizes, zero


class TorchEngine(Engine):
    name = "torch DistributedDataParallel"  # the launcher says more once made
    #: rank r's replica is built for B/N rows and keeps rows r*B/N ... of every batch
    supports_stateful = True
    shards = ("optimizer", "gradients", "weights")

    def __init__(self, config):
        super().__init__(config)
        self.rank_rows = None  # for tests: each rank's real rows of the last *_on_batch
        self.launcher = launchers.choose(config)
        self.device_ids = self.launcher.device_ids
        self.device_names = self.launcher.device_names
        self.name = self.launcher.name

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        # Keras's own torch fit crashes on stateful LSTMs: those need the engine.
        return (list(device_ids) == [0] and not launchers.in_distributed_job()
                and not replication.stateful_layers(model))

    # -- the Engine interface ---------------------------------------------------------
    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        """One call, the same way whichever launcher runs the ranks.

        The launcher gives the ranks the template's state and runs the call; rank 0
        relays the hooks of the user's callbacks to a CallbackDriver here (the
        driver loads the ranks' state into the template when a callback needs it);
        then the stateful RNN rows, the trained state and the result come back. A
        failed fit leaves the last consistent state in the template.
        """
        lr_scale = (float(lr_scale[0]), int(lr_scale[1]))
        if template.compiled and self.num_replicas > 1:
            kwargs = batch_checks.check_weighable(template, kwargs, method)  # before any work
            if self.config.shard_optimizer:
                zero.check(template.optimizer, self.config.shard, template.trainable_weights)
        resets = (bool(replication.stateful_layers(template))
                  and self.config.reset_states == "epoch" and not method.endswith("_on_batch"))
        if resets:
            replication.reset_states(template)  # what the ranks start from; they reset each epoch
        kwargs = dict(kwargs)
        callbacks = kwargs.pop("callbacks", None)
        launcher, clock = self.launcher, timing.Clock("parent")
        # a pool's driver holds the user's model beside rank 0's GPU (under torchrun each
        # process's own model is filled from its replica: it stays where Keras put it)
        host = (self.config.shard is not None and self.num_replicas > 1
                and isinstance(launcher, launchers.PoolLauncher))
        if host:
            to_host(template)  # no whole copy on device 0 while the ranks hold 1/N
        try:
            driver = relay.CallbackDriver(
                callbacks if launcher.runs_callbacks else None, template, method,
                load_state=lambda: _timed(clock, "state loads", launcher.load_state, template),
                push_state=lambda: launcher.push_state(template))
            config = self.config
            call = Call(method=method, config=config,
                        key=(replicas.replica_key(template, config.sync_batchnorm, lr_scale),
                             config),
                        kwargs=kwargs, rng=shuffle.state(), lr_scale=lr_scale,
                        hooks=tuple(sorted(driver.hooks)), epoch_weights=driver.needs_weights,
                        slots_back=driver.reads_state,
                        rnn_states=replicas.states_of(template), reset_states=resets)
            try:
                answers = launcher.launch(call, template, driver, clock)
            except BaseException:
                if method == "fit":
                    launcher.load_state(template)  # the last consistent state
                raise
            if answers[0].rng is not None and not any(  # else the driver drew them, reading
                    feeds.reads_itself(kwargs.get(k)) for k in ("x", "validation_data")):
                shuffle.set_state(answers[0].rng)  # where plain Keras's draws leave them
            replicas.states_back(template, [a.states for a in answers])
            out = self._finish(method, template, [a.result for a in answers], driver)
            self.rank_rows = [a.rows for a in answers]
            clock("state back")
            clock.report()
        except BaseException:
            launcher.end_call(failed=True)
            raise
        launcher.end_call(failed=False, touched=any(a.touched for a in answers))
        if host:
            to_host(template)  # an optimizer built by the state load comes here too
        return out

    def _finish(self, method, template, results, driver):
        """The call's return value, once every rank has answered."""
        if driver.error is not None or isinstance(results[0], Aborted):
            if method == "fit":
                self.launcher.load_state(template)  # the last consistent state (epoch snapshot)
            if driver.error is not None:
                raise driver.error
            if getattr(results[0], "error", None) is not None:  # a refused batch
                raise results[0].error
            raise RuntimeError("kmgpu: the call was aborted")
        if method == "fit":
            if not driver.final_loaded:
                self.launcher.load_state(template)
            template.history = driver.history
            return driver.history
        if method == "train_on_batch":
            self.launcher.load_state(template)  # rank 0's state after the step
        if method in ("predict", "predict_on_batch"):
            return inputs.assemble(results)
        return results[0]

    def train_step_mode(self, template):
        on_gpu = self.device_names[0].startswith("gpu")
        text = graphs.describe(template, on_gpu, self.num_replicas, self.config.sync_batchnorm,
                               tf32=self.config.tf32)
        if self.config.shard_optimizer and self.num_replicas > 1:
            text = sizes.describe(text, self.num_replicas, template, self.config.shard)
        return (text + (eval_steps.WORDS if on_gpu and not template.run_eagerly else "")
                + fast_layers.describe(template, on_gpu)
                + fast_layers.describe_ops(template, on_gpu))

    def sharded_bytes(self, template, kind):
        shard, n = self.config.shard, self.num_replicas
        by_layer = shard == "weights"  # one flat buffer per layer, each padded
        if kind == "optimizer":
            return sizes.state_bytes(template, n, by_layer)
        if kind == "gradients" and shard in ("gradients", "weights"):
            return sizes.grad_bytes(template, n, by_layer)
        if kind == "weights" and shard == "weights":
            return sizes.weight_bytes(template, n)
        return None

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        if self.config.sync_batchnorm:
            return "global batch (sums all-reduced in the forward pass, with autograd)"
        return ("per replica; moving statistics averaged over replicas (weighted by "
                "batch share) after every step")

    def close(self):
        self.launcher.close()

    # -- for tests and describe() ---------------------------------------------------
    @property
    def copied_in(self):
        """Arrays of the template's state the last call sent to the ranks (0: none)."""
        return self.launcher.copied_in

    def worker_pids(self):
        """The pool's worker process ids (empty in-process or before the first call)."""
        return self.launcher.worker_pids()

    def rank_weights(self):
        """Every rank's replica weights (trainable and non-trainable), rank order."""
        return self.launcher.rank_weights()

    def rank_held_bytes(self):
        """Every rank's bytes of weights, gradients and optimizer state its sharded
        train step holds now (between calls: what it keeps), rank order."""
        return self.launcher.rank_held_bytes()


def to_host(template):
    """With shard="gradients" / "weights" on GPUs: the user's model's weights and
    optimizer variables in host memory (each torch Parameter's data moved to the CPU,
    the Keras variables the same objects), so the process that holds the user's model
    keeps no whole copy on a GPU while the ranks keep 1/N; ``save``, ``load_model`` and
    the next call read and write them there. A no-op for variables already on the CPU
    (every CPU run)."""
    import torch

    opt = getattr(template, "optimizer", None)
    variables = list(template.weights) + (list(opt.variables) if opt is not None
                                          and opt.built else [])
    with torch.no_grad():
        for v in variables:
            value = held.raw(v)  # a slot the ranks keep stays there (``optim.held``)
            if torch.is_tensor(value) and value.device.type != "cpu":
                value.data = value.data.cpu()


def _timed(clock, name, fn, *args):
    import time

    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        clock(name, since=start)


class TorchLocalEngine(LocalEngine):
    """One device: the user's own ``fit``. On a CUDA device (or compiled with
    ``jit_compile=True``) its train step is ``graphs.CapturedStep``: CUDA graphs on a
    GPU, the same split step eagerly on a CPU; Keras compiles nothing (``graphs.choose_step``
    says which step a model gets). The graphs live until ``close()`` or another model."""

    def __init__(self, config):
        super().__init__(config)
        self._step, self._key, self._said, self._eval = None, None, None, None

    def _on_gpu(self, template):
        return graphs.available(graphs.device_of(template))

    def train_step_mode(self, template):
        step = self._step if self._key == replication.identity(template) else None
        text = graphs.describe(template, self._on_gpu(template), 1,
                               graph_bytes=step.graph_bytes if step else None,
                               tf32=self.config.tf32)
        if self._on_gpu(template) and not template.run_eagerly:
            text += eval_steps.WORDS
        return (text + fast_layers.describe(template, self._on_gpu(template))
                + fast_layers.describe_ops(template, self._on_gpu(template)))

    def graph_memory(self):
        """Bytes of GPU memory the captured steps' graphs hold now (0: none)."""
        return sum(s.graph_bytes for s in (self._step, self._eval) if s is not None)

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        kind, why = graphs.choose_step(template, self._on_gpu(template))
        jit = capture_fixes.wants_captured_step(template)
        if kind == graphs.OWN and self._on_gpu(template) and self._said != id(template):
            self._said = id(template)
            print(f"kmgpu (torch): the train step runs eagerly, not captured: {why}")
        key = replication.identity(template)
        if key != self._key:  # graphs live across calls on one model
            self.close()
            self._key = key
        evals = self._evals(template, method, kind)
        device = graphs.device_of(template)
        with evals:
            if kind != graphs.SPLIT or method != "fit":
                if method in ("evaluate", "predict") and self._eval is not None:
                    kwargs = resident.device_eval_feed(method, kwargs, device)
                if not jit and self._eval is None:
                    return super().run(method, template, kwargs, lr_scale)
                with graphs.eager_keras(template):  # no torch.compile
                    return super().run(method, template, kwargs, lr_scale)
            if self._step is None:
                self._step = graphs.local_step(template, tf32=self.config.tf32)
            with graphs.installed(template, self._step):
                return template.fit(**resident.device_feed(kwargs, device))

    def _evals(self, template, method, kind):
        """The captured test / predict steps installed for this call (a context), on a
        CUDA device unless compile(run_eagerly=True); on a CPU Keras's own."""
        import contextlib

        if (method not in ("fit", "evaluate", "predict") or not self._on_gpu(template)
                or template.run_eagerly or (method == "fit" and kind != graphs.SPLIT)):
            return contextlib.nullcontext()
        kinds = eval_steps.capturable(template)
        if not kinds:
            return contextlib.nullcontext()
        if self._eval is None:
            self._eval = eval_steps.CapturedEval(template, graphs.device_of(template),
                                                 tf32=self.config.tf32)
        return graphs.installed(template, self._eval, kinds)

    def close(self):
        if self._step is not None:
            self._step.close()
        if self._eval is not None:
            self._eval.close()
        self._step, self._key, self._eval = None, None, None


TorchEngine.local_engine = TorchLocalEngine

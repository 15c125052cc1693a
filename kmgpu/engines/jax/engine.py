"""JAX engine: ``keras.distribution.DataParallel`` over a 1-D ``jax.sharding`` mesh.

Variables are replicated, each batch is sharded along its first axis, and XLA's
SPMD partitioner inserts the gradient all-reduce.

BatchNormalization, ``sync_batchnorm=False`` (the default): each replica normalises
with the moments of its own rows, as torch DDP and MirroredStrategy do, with no
collective in the layer's forward or backward pass (``batchnorm.py``); the moving
statistics are updated with the mean over replicas of the per-replica moments (one
small all-reduce per layer that the step does not wait on). ``sync_batchnorm=True``:
Keras's own layer under SPMD computes the moments over the sharded global batch,
exactly as on one device, at the price of an all-reduce in the forward and one in
the backward pass of every BatchNormalization, one after the other on the critical
path (ResNet-50 at 64x64 on 2 GPUs ran at 0.58x of one GPU that way).

Keras 3 raises ``IndivisibleError`` for a batch whose size the device count does
not divide. kmgpu places such a batch (the last partial one, or a batch smaller
than the device count) replicated on every device instead: each device computes
the whole batch, the step equals the one-device step, and no sample is dropped.
With local BatchNorm such a batch normalises with the moments of the whole batch
(every device holds all of it; still no collective).

The train step (``packed.py``): in each model's first ``fit`` kmgpu times Keras's own
jitted step against one that passes the model state as a few flat arrays (Keras's
passes each of ~750 arrays on ResNet-50: 12 ms of host time per step on one H200) and
keeps the faster, on one device (``JaxLocalEngine``) and on several.
``KMGPU_JAX_FAST=0``: Keras's own step, kmgpu adds nothing.
"""

import contextlib

from kmgpu.engines.base import InProcessEngine
from kmgpu.engines.jax import keras_fixes, packed
from kmgpu.engines.local import LocalEngine


class _PackedSteps:
    """The packed train step (``packed.py``) of one compiled model, kept across calls."""

    def __init__(self):
        self.function, self.key = None, None

    def context(self, method, model):
        if method != "fit" or not packed.applies(model):
            return contextlib.nullcontext()
        key = keras_fixes.compiled_with(model)
        if (self.function is None or self.function.model is not model or self.key is not key
                or self.function.mode != packed.mode()):
            self.function, self.key = packed.PackedTrainFunction(model, packed.mode()), key
        return keras_fixes.train_function(model, self.function)

    def describe(self, model):
        if not (model is not None and getattr(model, "compiled", False)):
            return None
        if not packed.applies(model):
            why = ("KMGPU_JAX_FAST=0" if not packed.enabled() else
                   "run_eagerly, jit_compile=False or steps_per_execution > 1")
            return f"Keras's own jitted step ({why})"
        return packed.describe(self.function if self.function
                               and self.function.model is model else None)


class JaxEngine(InProcessEngine):
    name = "keras.distribution.DataParallel (jax.sharding)"

    def __init__(self, device_ids, available, options):
        super().__init__(device_ids, available, options)
        import jax
        import keras

        devices = jax.devices()
        self.distribution = keras.distribution.DataParallel(
            devices=[devices[i] for i in device_ids]
        )
        from kmgpu.engines.jax import runtime

        self._packed = _PackedSteps()
        self.multiprocess = runtime.multiprocess()  # kmgpu launch: jax.distributed
        if self.multiprocess:  # every process passes the same data; kmgpu places it
            self.distribution.auto_shard_dataset = False
            self.name += f", {jax.process_count()} processes (jax.distributed)"

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        # Keras's own JAX fit drops stateful RNN states: those need the engine.
        import jax

        from kmgpu import models

        return (list(device_ids) == [0] and jax.process_count() == 1
                and not models.stateful_layers(model))

    def scope(self):
        return self.distribution.scope()

    def prepare_replica(self, replica, template):
        d = self.distribution
        self._bn = (0, [])
        if not self.options.sync_batchnorm and self.num_replicas > 1:
            self._bn = keras_fixes.local_batchnorm(replica, d)
        keras_fixes.track_states(replica, d)  # stateful RNNs: carried through the jit
        if self.multiprocess:
            keras_fixes.replicated_predictions(replica, d.device_mesh.backend_mesh)

    @contextlib.contextmanager
    def call_context(self, method):
        # several processes: each would measure and choose alone, and all must run the
        # same program; they keep Keras's step
        steps = contextlib.nullcontext() if self.multiprocess else self._packed.context(
            method, self.replica)
        with keras_fixes.replicate_indivisible(self.distribution), steps:
            yield

    def train_step_mode(self, template):
        if self.multiprocess:
            return "Keras's own jitted step (several processes)"
        return self._packed.describe(self.replica or template)

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        if self.options.sync_batchnorm:
            return ("global batch (sync_batchnorm=True: exact as one device; an all-reduce "
                    "in the forward and the backward pass of every BatchNormalization)")
        text = ("per replica (each device's own rows, no collective; moving statistics: "
                "mean over replicas, one small all-reduce per layer off the critical path)")
        kept = getattr(self, "_bn", (0, []))[1]
        if kept:  # known once the replica exists (the first call)
            names = ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else "")
            text += (f"; global batch in {len(kept)} layer(s) with renorm, synchronized=True "
                     f"or their own call ({names})")
        return text


class JaxLocalEngine(LocalEngine):
    """One device: the user's own ``fit``, with kmgpu's packed train step
    (``packed.py``: the state as a few flat arrays; Keras's own step where it does not
    apply, or with KMGPU_JAX_FAST=0)."""

    def __init__(self, device_ids, available, options):
        super().__init__(device_ids, available, options)
        self._packed = _PackedSteps()

    def train_step_mode(self, template):
        return self._packed.describe(template)

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        import keras

        if keras.distribution.distribution() is not None:  # the user's own: Keras's step
            return super().run(method, template, kwargs, lr_scale)
        with self._packed.context(method, template):
            return super().run(method, template, kwargs, lr_scale)

    def close(self):
        self._packed = _PackedSteps()


JaxEngine.local_engine = JaxLocalEngine

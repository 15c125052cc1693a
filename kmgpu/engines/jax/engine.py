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
"""

from kmgpu.engines.base import InProcessEngine
from kmgpu.engines.jax import keras_fixes


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

    def call_context(self, method):
        return keras_fixes.replicate_indivisible(self.distribution)

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

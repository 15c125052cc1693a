"""JAX engine: ``keras.distribution.DataParallel`` over a 1-D ``jax.sharding`` mesh.

Variables are replicated, each batch is sharded along its first axis, and XLA's
SPMD partitioner inserts the gradient all-reduce. BatchNormalization moments are
computed over the sharded global batch, so they are always synchronised.

Keras 3 raises ``IndivisibleError`` for a batch whose size the device count does
not divide. kmgpu places such a batch (the last partial one, or a batch smaller
than the device count) replicated on every device instead: each device computes
the whole batch, the step equals the one-device step, and no sample is dropped.
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
        keras_fixes.track_states(replica, d)  # stateful RNNs: carried through the jit
        if self.multiprocess:
            keras_fixes.replicated_predictions(replica, d.device_mesh.backend_mesh)

    def call_context(self, method):
        return keras_fixes.replicate_indivisible(self.distribution)

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        return "global batch (XLA SPMD computes the moments over the sharded batch)"

"""JAX engine: ``keras.distribution.DataParallel`` over a 1-D ``jax.sharding`` mesh.

Variables are replicated, each batch is sharded along its first axis, and XLA's
SPMD partitioner inserts the gradient all-reduce. BatchNormalization moments are
computed over the sharded global batch, so they are always synchronised.

Keras 3 raises ``IndivisibleError`` for a batch whose size the device count does
not divide. kmgpu places such a batch (the last partial one, or a batch smaller
than the device count) replicated on every device instead: each device computes
the whole batch, the step equals the one-device step, and no sample is dropped.
"""

import contextlib

from kmgpu.engines.base import InProcessEngine


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

    def scope(self):
        return self.distribution.scope()

    def call_context(self, method):
        return _replicate_indivisible(self.distribution)

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        return "global batch (XLA SPMD computes the moments over the sharded batch)"


@contextlib.contextmanager
def _replicate_indivisible(distribution):
    """Within the block, Keras's JAX trainer replicates batches it cannot shard evenly.

    The trainer caches one layout per epoch from the first batch and calls the
    module-level ``_distribute_data(data, layouts)`` for every batch; this wraps it.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from keras.src.backend.jax import trainer as jax_trainer
    from keras.src import tree

    original = jax_trainer._distribute_data
    n = distribution.num_model_replicas
    replicated = NamedSharding(distribution.device_mesh.backend_mesh, PartitionSpec())

    def distribute(data, layouts=None):
        flat = [d for d in tree.flatten(data) if d is not None]
        if all(d.shape and d.shape[0] % n == 0 for d in flat):
            return original(data, layouts)
        return tree.map_structure(
            lambda d: None if d is None else jax.device_put(d, replicated), data
        )

    jax_trainer._distribute_data = distribute
    try:
        yield
    finally:
        jax_trainer._distribute_data = original

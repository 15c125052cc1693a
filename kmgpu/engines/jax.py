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
        from kmgpu.engines import _multiworker

        self.multiprocess = _multiworker.jax_multiprocess()  # kmgpu launch: jax.distributed
        if self.multiprocess:  # every process passes the same data; kmgpu places it
            self.distribution.auto_shard_dataset = False
            self.name += f", {jax.process_count()} processes (jax.distributed)"

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        # Keras's own JAX fit drops stateful RNN states: those need the engine.
        import jax

        from kmgpu import stateful

        return (list(device_ids) == [0] and jax.process_count() == 1
                and not stateful.layers(model))

    def scope(self):
        return self.distribution.scope()

    def prepare_replica(self, replica, template):
        """Stateful RNN states join the model's non-trainable variables, sharded by rows.

        Keras's JAX trainer carries only tracked variables through its jitted
        steps (an untracked state would be a constant: no state carried). Tracked,
        they travel with the BatchNorm statistics; laid out along the batch axis,
        device r keeps rows r*B/N ... (r+1)*B/N - 1, as its data shard.
        """
        import keras

        from kmgpu import stateful

        d = self.distribution
        for layer in stateful.layers(replica):
            locked = layer._tracker.locked
            layer._tracker.unlock()
            for v in keras.tree.flatten(layer.states):
                layer._track_variable(v)
                v._layout = keras.distribution.TensorLayout(
                    [d.batch_dim_name] + [None] * (len(v.shape) - 1), d.device_mesh)
                v.assign(v.value)
            if locked:
                layer._tracker.lock()
        if self.multiprocess:
            from kmgpu.engines import _multiworker

            _multiworker.jax_replicated_predictions(replica, d.device_mesh.backend_mesh)

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
        if jax.process_count() > 1:  # each process holds the whole batch (kmgpu launch)
            from kmgpu.engines import _multiworker

            return _multiworker.jax_put_global(data, replicated.mesh, distribution.batch_dim_name)
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

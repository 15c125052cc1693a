"""Batches as Keras's JAX trainer places them under ``keras.distribution``: one the
device count does not divide goes replicated instead of failing. Rows of
``kmgpu/engines/jax/keras_fixes.py``.
"""

from kmgpu.engines import keras_fixes


def model_replicas(distribution):
    """The number of model replicas of kmgpu's ``keras.distribution.DataParallel``: its
    mesh's devices.

    Keras differs here: 3.15 has ``Distribution.num_model_replicas`` (for DataParallel,
    ``device_mesh.devices.size``); 3.14 has no such property. This reads the public mesh
    both have, which is what 3.15's property returns.
    """
    return int(distribution.device_mesh.devices.size)


def replicate_indivisible(distribution):
    """Within the block, Keras's JAX trainer replicates batches it cannot shard evenly.

    The trainer caches one layout per epoch from the first batch and calls the
    module-level ``_distribute_data(data, layouts)`` for every batch; this wraps it.
    """
    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec
    from keras.src.backend.jax import trainer as jax_trainer

    n = model_replicas(distribution)
    replicated = NamedSharding(distribution.device_mesh.backend_mesh, PartitionSpec())

    def replicating(original):
        def distribute(data, layouts=None):
            if jax.process_count() > 1:  # each process holds the whole batch (kmgpu launch)
                from kmgpu.engines.jax import runtime

                return runtime.put_global(data, replicated.mesh, distribution.batch_dim_name)
            flat = [d for d in keras.tree.flatten(data) if d is not None]
            if all(d.shape and d.shape[0] % n == 0 for d in flat):
                if layouts is None and len(flat) < len(keras.tree.flatten(data)):
                    # Keras 3.14's _distribute_data reads the shape of every leaf, None
                    # included (train_on_batch's sample_weight=None); 3.15 skips None
                    return keras.tree.map_structure(
                        lambda d: None if d is None else original(d), data)
                return original(data, layouts)
            return keras.tree.map_structure(
                lambda d: None if d is None else jax.device_put(d, replicated), data
            )
        return distribute

    return keras_fixes.swapped((jax_trainer, "_distribute_data", replicating))

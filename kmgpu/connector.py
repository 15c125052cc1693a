"""The one place where the user's options, the devices and the environment become an
engine (as Lightning Fabric's connector): which backend, which devices, which engine.

The front (``api.py``) never asks which backend runs; each engine lives in
``kmgpu/engines/<backend>/`` and is imported only here.
"""

from kmgpu import environment, hardware, models, plan
from kmgpu.engines import engine_class

#: backends whose engine has no sharded optimizer state (``shard_optimizer=True``): why
NO_SHARDED_OPTIMIZER = {
    "tensorflow": "tf.distribute.MirroredStrategy has no sharded optimizer state (every "
                  "replica keeps a whole copy)",
    "torch": "it is not yet available on the torch backend",
}


def connect(model, gpus, options):
    """Check ``model`` and ``gpus`` and make the engine that will run it.

    Args:
        model: the user's built ``keras.Model``.
        gpus: the ``gpus=`` argument of ``parallelize``.
        options: ``plan.Options``.

    Returns:
        (engine, backend name).

    Raises:
        TypeError / ValueError / NotImplementedError, saying what to do instead;
        nothing of the model is changed.
    """
    models.check_model(model)
    backend = hardware.backend_name()
    if options.shard_optimizer and backend in NO_SHARDED_OPTIMIZER:
        raise NotImplementedError(
            f"shard_optimizer=True: {NO_SHARDED_OPTIMIZER[backend]}. The JAX backend has it "
            "(KERAS_BACKEND=jax); or pass shard_optimizer=False (the default).")
    cls = engine_class(backend)
    if models.stateful_layers(model) and not cls.supports_stateful:
        raise NotImplementedError(
            f"{model.name} has stateful RNN layers, which kmgpu's {backend} engine does not "
            "support yet: use the tensorflow or jax backend, or stateful=False.")
    available = hardware.physical_devices(backend)
    ids = hardware.resolve(gpus, available)
    if environment.job() is None and cls.plain_fit_serves(model, ids):  # several processes: never
        from kmgpu.engines.local import LocalEngine

        cls = cls.local_engine or LocalEngine
    engine = cls(ids, available, options)
    plan.check_stateful_split(model, engine.num_replicas)  # all processes' devices under launch
    return engine, backend

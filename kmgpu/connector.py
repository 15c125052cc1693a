"""The one place where the user's options, the devices and the environment become an
engine (as Lightning Fabric's connector): which backend, which devices, which engine.

The front (``api.py``) never asks which backend runs; each engine lives in
``kmgpu/engines/<backend>/`` and is imported only here.
"""

from kmgpu import checks, environment, hardware, plan
from kmgpu.engines import engine_class, replication

#: backends whose engine has no sharded optimizer state (``shard_optimizer=True``): why
NO_SHARDED_OPTIMIZER = {
    "tensorflow": "tf.distribute.MirroredStrategy has no sharded optimizer state (every "
                  "replica keeps a whole copy)",
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
    checks.check_model(model)
    backend = hardware.backend_name()
    _check_options(options, backend)
    cls = engine_class(backend)
    if replication.stateful_layers(model) and not cls.supports_stateful:
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


def _check_options(options, backend):
    if options.shard_optimizer and backend in NO_SHARDED_OPTIMIZER:
        raise NotImplementedError(
            f"shard_optimizer=True: {NO_SHARDED_OPTIMIZER[backend]}. The JAX and torch "
            "backends have it (KERAS_BACKEND=jax or torch); or pass shard_optimizer=False "
            "(the default).")


def unbuilt(model):
    """True for a Keras model without weights yet (a Sequential without ``Input``)."""
    import keras

    return isinstance(model, keras.Model) and not model.built


def check_unbuilt(model, gpus, options):
    """Check what can be checked of an unbuilt model before its first batch: its config,
    ``gpus`` and ``options``. Returns the backend name."""
    import keras

    try:
        model.get_config()
    except NotImplementedError:
        checks.check_model(model)  # says what to implement
    if not isinstance(model, keras.Sequential) and not getattr(model, "_is_graph_network",
                                                                 False):
        raise ValueError(
            f"kmgpu.parallelize needs a built {type(model).__name__}: call model(x) once, or "
            "model.build(input_shape), before wrapping it (an unbuilt Sequential is built "
            "from the first batch, as plain Keras does).")
    backend = hardware.backend_name()
    _check_options(options, backend)
    hardware.resolve(gpus, hardware.physical_devices(backend))
    return backend


def build_from(model, x):
    """Build an unbuilt model from the first batch of ``x``, as Keras's ``fit`` does
    (symbolically: no step runs, the weights are created in the same order with the
    same seeds), with the batch dimension left free for the replicas' smaller batches.
    ``x`` that is not data is left alone (the checks refuse it)."""
    import keras

    from kmgpu.engines import datasets

    if model.built or x is None or isinstance(x, (str, bytes)):
        return
    if datasets.is_dataset(x):
        x = _first_inputs(x)

    def symbolic(leaf):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            raise TypeError(f"cannot build {model.name} from a {type(leaf).__name__}: pass "
                            "arrays, or build the model first (keras.Input(shape=...)).")
        dtype = keras.backend.standardize_dtype(leaf.dtype)
        if dtype.startswith("float"):
            dtype = keras.config.floatx()  # Keras's data adapters cast floats so
        return keras.KerasTensor((None,) + tuple(shape[1:]), dtype)

    model(keras.tree.map_structure(symbolic, x))


def _first_inputs(data):
    """The inputs of the first batch of a dataset that can be read twice."""
    import keras

    if isinstance(data, keras.utils.PyDataset):
        batch = data[0]
    elif iter(data) is not data:  # tf.data, a torch DataLoader: iterating again restarts
        batch = next(iter(data))
    else:
        raise ValueError(
            "a generator can be read only once, so kmgpu cannot build the model from its "
            "first batch: build the model first (keras.Input(shape=...) as its first layer, "
            "or model.build(input_shape)) before kmgpu.parallelize.")
    return batch[0] if isinstance(batch, (tuple, list)) else batch  # (x, y[, w]) as Keras reads it

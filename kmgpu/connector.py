"""The one place where the user's options, the devices and the environment become an
engine (as Lightning Fabric's connector): which backend, which devices (``gpus=``
resolved here only), one ``Config`` record of them all, and which engine runs it.

The front (``api.py``) never asks which backend runs; each engine lives in
``kmgpu/engines/<backend>/`` and is imported only here.
"""

from kmgpu import checks, environment, hardware, plan, versions
from kmgpu.engines import engine_class, replication
from kmgpu.engines.base import Config


def connect(model, gpus, options):
    """Check ``model``, ``gpus`` and ``options``, make the run's one ``Config`` and, for a
    built model, the engine that will run it.

    ``gpus`` is resolved here and nowhere else: the Config holds the devices from then
    on (an unbuilt model's engine is made from it by ``engine_for`` after its first
    batch builds it).

    Args:
        model: the user's ``keras.Model``, built, or unbuilt (a Sequential without
            ``Input``, built from its first batch).
        gpus: the ``gpus=`` argument of ``parallelize``.
        options: ``plan.options(...)``: the other arguments, checked.

    Returns:
        (config, backend name, engine or None for an unbuilt model).

    Raises:
        TypeError / ValueError / NotImplementedError, saying what to do instead;
        nothing of the model is changed.
    """
    if unbuilt(model):
        _check_unbuilt(model)
    else:
        checks.check_model(model)
    backend = hardware.backend_name()
    versions.check_keras()  # once per process: a Keras outside the tested range warns
    _check_options(options, backend)
    available = hardware.physical_devices(backend)
    ids = hardware.resolve(_in_a_job(gpus), available)
    config = Config(device_ids=tuple(ids), devices=tuple(available[i] for i in ids), **options)
    if unbuilt(model):
        return config, backend, None
    return config, backend, _engine(model, config, backend)


def engine_for(model, config, backend):
    """The engine for a model that was unbuilt at ``connect``, now that it is built."""
    checks.check_model(model)
    return _engine(model, config, backend)


def _engine(model, config, backend):
    cls = engine_class(backend)
    if replication.stateful_layers(model) and not cls.supports_stateful:
        raise NotImplementedError(
            f"{model.name} has stateful RNN layers, which kmgpu's {backend} engine does not "
            "support yet: use the tensorflow or jax backend, or stateful=False.")
    # several processes: never the one-device engine
    if environment.job() is None and cls.plain_fit_serves(model, config.device_ids):
        from kmgpu.engines.local import LocalEngine

        cls = cls.local_engine or LocalEngine
    engine = cls(config)
    plan.check_stateful_split(model, engine.num_replicas)  # all processes' devices under launch
    return engine


_SAID = []  # gpus= was set aside in a job (said once per process, by the main one)


def _in_a_job(gpus):
    """``gpus`` as a job of several processes takes it: each process has the devices its
    launcher gave it, so ``gpus=`` is set aside and the main process says so once."""
    if gpus is None or (environment.job() is None and environment.process_count() == 1):
        return gpus
    if not _SAID and environment.is_main_process():
        import warnings

        warnings.warn(
            f"kmgpu: gpus={gpus!r} is not applied in a job of several processes: each "
            "process uses the devices its launcher gives it (torch: the GPU of its local "
            "rank; TensorFlow and JAX: every GPU it sees). Choose them with "
            "CUDA_VISIBLE_DEVICES on each host and `kmgpu launch --nproc-per-node`.",
            stacklevel=4)
    _SAID.append(True)
    return None


def _check_options(options, backend):
    shard, cls = options["shard"], engine_class(backend)
    if shard is None or shard in cls.shards:
        return
    if not cls.shards:
        raise NotImplementedError(
            f"shard={shard!r}: {cls.no_sharding}. The JAX and torch backends shard "
            "(KERAS_BACKEND=jax or torch); or pass shard=None (the default).")
    raise NotImplementedError(
        f"shard={shard!r} is not available on the {backend} engine, which shards "
        f"{', '.join(map(repr, cls.shards))}: pass one of those or shard=None.")


def unbuilt(model):
    """True for a Keras model without weights yet (a Sequential without ``Input``)."""
    import keras

    return isinstance(model, keras.Model) and not model.built


def _check_unbuilt(model):
    """Check what can be checked of an unbuilt model before its first batch: its config,
    and that its first batch can build it."""
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

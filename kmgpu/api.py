"""``parallelize`` and ``ParallelModel``: the backend-neutral front."""

import inspect
import warnings

from kmgpu import hardware
from kmgpu import plan
from kmgpu.engines import engine_class


def parallelize(model, gpus=None, *, batch="global", scale_lr=None, warmup_epochs=0,
                sync_batchnorm=False):
    """Wrap a built Keras model so fit / evaluate / predict run on several devices.

    Args:
        model: a built ``keras.Model`` (Sequential, functional, or subclassed with
            ``get_config``). It stays the user's: after every fit it holds the
            trained weights.
        gpus: None (every device), an int N (the first N), a list of ids such as
            [0, 2], or a dict such as {'main': 0, 'second': 1}.
        batch: "global" (fit's batch_size is the global batch) or "per_replica"
            (batch_size per device; global batch = N x batch_size).
        scale_lr: multiply the learning rate by N (linear scaling rule). None means
            True for batch="per_replica", else False.
        warmup_epochs: ramp the scaled learning rate up from the base rate over this
            many epochs (Goyal et al. 2017).
        sync_batchnorm: BatchNormalization statistics over the global batch.

    Returns:
        A ``ParallelModel``.
    """
    from kmgpu import replicas

    options = plan.Options.make(batch, scale_lr, warmup_epochs, sync_batchnorm)
    replicas.check_model(model)
    backend = hardware.backend_name()
    cls = engine_class(backend)
    available = hardware.physical_devices(backend)
    ids = hardware.resolve(gpus, available)
    engine = cls(ids, available, options)
    if engine.num_replicas == 1:
        warnings.warn(
            f"kmgpu: one device ({engine.device_names[0]}) - running as a single replica.",
            stacklevel=2,
        )
    return ParallelModel(model, engine, options, backend)


def _keras_signature(name):
    import keras

    return inspect.signature(getattr(keras.Model, name))


class ParallelModel:
    """The user's model on N replicas; everything not defined here is the model's own."""

    def __init__(self, model, engine, options, backend):
        self.__dict__.update(model=model, _engine=engine, _options=options, _backend=backend,
                             _last_fit=None)

    # -- the contract -------------------------------------------------------------
    @property
    def num_replicas(self):
        return self._engine.num_replicas

    def compile(self, *args, **kwargs):
        """Compile the user's model (kmgpu's replicas compile from its settings)."""
        self.model.compile(*args, **kwargs)

    def fit(self, *args, **kwargs):
        """``keras.Model.fit``; ``batch_size`` follows the batch policy."""
        call = self._bind("fit", args, kwargs)
        self._require_compiled("fit")
        call = self._globalise(call, ("batch_size", "validation_batch_size"))
        samples = _num_samples(call.get("x"))
        self.__dict__["_last_fit"] = (samples, call.get("batch_size"))
        return self._engine.run("fit", self.model, call)

    def evaluate(self, *args, **kwargs):
        """``keras.Model.evaluate``: every sample exactly once."""
        call = self._bind("evaluate", args, kwargs)
        self._require_compiled("evaluate")
        return self._engine.run("evaluate", self.model, self._globalise(call, ("batch_size",)))

    def predict(self, *args, **kwargs):
        """``keras.Model.predict``: every sample exactly once, in order."""
        call = self._bind("predict", args, kwargs)
        return self._engine.run("predict", self.model, self._globalise(call, ("batch_size",)))

    def save(self, filepath, *args, **kwargs):
        """Save the user's model: a plain Keras file, loadable without kmgpu."""
        return self.model.save(filepath, *args, **kwargs)

    def describe(self, samples=None, batch_size=None):
        """The plan as text. Without arguments, uses the last fit's data size."""
        if samples is None and batch_size is None and self._last_fit:
            samples, batch_size = self._last_fit
        if batch_size is None:
            batch_size = plan.KERAS_DEFAULT_BATCH
        return plan.describe(backend=self._backend, engine=self._engine,
                             options=self._options, template=self.model,
                             samples=samples, batch_size=batch_size)

    def close(self):
        """Release the engine's devices and processes (also done at exit)."""
        self._engine.close()

    # -- pass-through -------------------------------------------------------------
    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __setattr__(self, name, value):
        setattr(self.model, name, value)

    def __repr__(self):
        return (f"<kmgpu.ParallelModel {self.model.name!r} on {self.num_replicas} "
                f"replica(s): {', '.join(self._engine.device_names)}>")

    # -- helpers ------------------------------------------------------------------
    def _bind(self, method, args, kwargs):
        try:
            bound = _keras_signature(method).bind(self.model, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"ParallelModel.{method}(): {e}. It takes the arguments of "
                            f"keras.Model.{method}.") from None
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.pop("self")
        call.update(call.pop("kwargs", {}))
        return call

    def _require_compiled(self, method):
        if not self.model.compiled:
            raise ValueError(
                f"{method}() needs a compiled model: call parallel.compile(optimizer=..., "
                "loss=...) (or compile your model before wrapping it) first."
            )

    def _globalise(self, call, keys):
        for key in keys:
            if key in call and (call[key] is not None or key == "batch_size"):
                size = call[key]
                if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                         or size < 1):
                    raise ValueError(f"{key}={size!r}: pass a positive int.")
                if size is None and _is_dataset(call.get("x")):
                    continue  # the dataset brings its own batches
                call[key] = plan.global_batch(self._options, size, self.num_replicas)
        return call


def _is_dataset(x):
    return x is not None and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict))


def _num_samples(x):
    import keras

    if x is None or _is_dataset(x):
        return None
    leaves = keras.tree.flatten(x)
    return int(leaves[0].shape[0]) if leaves and hasattr(leaves[0], "shape") else None

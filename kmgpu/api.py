"""``parallelize``, ``ParallelModel`` and ``rebatch``: the backend-neutral front."""

import inspect
import warnings

from kmgpu import checks, connector, environment, own_methods, plan
from kmgpu.engines import datasets, lr, replication


def parallelize(model, gpus=None, *, batch="global", scale_lr=None, warmup_epochs=0,
                sync_batchnorm=False, reset_states="epoch", drop_remainder=False,
                shard=None, shard_optimizer=False, tf32=True):
    """Wrap a Keras model (built, or a Sequential built by its first batch) so fit /
    evaluate / predict run on several devices.

    Args:
        model: a built ``keras.Model`` (Sequential, functional, or subclassed with
            ``get_config``). It stays the user's: after every fit it holds the
            trained weights. An unbuilt Sequential (no ``Input``) is built from the
            first batch of the first call, as plain Keras does; the replicas are made
            then. Any other model must be built before it is wrapped.
        gpus: None (every device; "all", "auto" and -1 mean the same), an int N (the
            first N), a list of ids such as
            [0, 2], or a dict such as {'main': 0, 'second': 1}.
        batch: "global" (fit's batch_size is the global batch) or "per_replica"
            (batch_size per device; global batch = N x batch_size).
        scale_lr: multiply the learning rate by N (linear scaling rule). None means
            True for batch="per_replica", else False.
        warmup_epochs: ramp the scaled learning rate up from the base rate over this
            many epochs (Goyal et al. 2017).
        sync_batchnorm: False (default): each replica normalises with its own rows'
            moments, no collective inside BatchNormalization; the moving statistics
            are the mean over replicas. True: moments over the global batch, equal
            to one device, at the price of collectives inside every
            BatchNormalization layer: in the forward pass two all-reduces per layer
            on TensorFlow, one on torch, those XLA places on JAX; their gradients in
            the backward pass.
        reset_states: stateful RNNs: "epoch" zeroes their states at the start of
            every epoch and every evaluate / predict call; None never does (call
            ``parallel.reset_states()``).
        drop_remainder: stateful RNNs: drop the samples after the last whole batch
            instead of raising an error.
        shard: what is laid out over the devices, 1/N on each: None (nothing, the
            default), "optimizer" (the optimizer's state: Adam's moments, momentum...;
            ZeRO stage 1), "gradients" (and the gradients; ZeRO-2) or "weights" (and
            the weights, gathered as they are used; ZeRO-3 / FSDP). JAX (any
            optimizer) and torch (Keras's elementwise optimizers: SGD, Adam, AdamW,
            RMSprop, Adagrad, Lion, Nadam, Adamax); a no-op on one device.
        shard_optimizer: True is ``shard="optimizer"``.
        tf32: torch on CUDA: float32 matmuls and convolutions inside kmgpu's steps
            use TF32, as JAX and TensorFlow do by default (True), or full float32
            (False); the process's own torch settings stay as they are outside them.

    Returns:
        A ``ParallelModel``.
    """
    options = plan.options(batch, scale_lr, warmup_epochs, sync_batchnorm, reset_states,
                           drop_remainder, shard, shard_optimizer, tf32)
    config, backend, engine = connector.connect(model, gpus, options)
    if engine is not None:  # else built from the first batch, as plain Keras does
        _warn_one_device(engine, config, stacklevel=3)
    return ParallelModel(model, engine, config, backend)


def _warn_one_device(engine, config, stacklevel):
    if engine.num_replicas == 1:
        warnings.warn(
            f"kmgpu: one device ({engine.device_names[0]}) - running as a single replica.",
            stacklevel=stacklevel,
        )
        if config.shard:
            warnings.warn(f"kmgpu: shard={config.shard!r} on one device: nothing to shard, "
                          "everything stays whole on that device (a no-op).",
                          stacklevel=stacklevel)


def _keras_signature(name):
    import keras

    return inspect.signature(getattr(keras.Model, name))


class ParallelModel:
    """The user's model on N replicas; everything not defined here is the model's own.

    Attributes:
        model: the user's own Keras model; it holds the trained weights after every fit.
        num_replicas: the number of devices the model runs on (N).
    """

    def __init__(self, model, engine, config, backend):
        self.__dict__.update(model=model, _engine=engine, _config=config, _backend=backend,
                             _last_fit=None, _lr_scale=(1.0, 0), _warned=False)

    # -- the contract -------------------------------------------------------------
    @property
    def num_replicas(self):
        """N, the number of devices (replicas) fit, evaluate and predict run on."""
        if self._engine is None:  # an unbuilt model: the devices it will use
            return len(self._config.device_ids)
        return self._engine.num_replicas

    def compile(self, *args, **kwargs):
        """Compile the user's model (kmgpu's replicas compile from its settings)."""
        checks.compile_args(self.model, args, kwargs)  # a refused compile leaves it as it was
        self.model.compile(*args, **kwargs)

    def fit(self, *args, **kwargs):
        """``keras.Model.fit``; ``batch_size`` follows the batch policy."""
        return self._through_own("fit", args, kwargs, self._fit)

    def _fit(self, *args, **kwargs):
        call = self._bind("fit", args, kwargs)
        self._require_compiled("fit")
        user_batch = call.get("batch_size")
        call = self._globalise(call, ("batch_size", "validation_batch_size"))
        vd = call.get("validation_data")
        if (call.get("validation_batch_size") is None and datasets.is_dataset(call.get("x"))
                and vd is not None and not datasets.is_dataset(vd)
                and not call.get("validation_steps")):
            # arrays validating a dataset: Keras batches them by its default, a
            # per-device batch under batch="per_replica" (with validation_steps Keras
            # splits the rows into that many batches instead)
            call["validation_batch_size"] = plan.global_batch(self._config, None,
                                                              self.num_replicas)
        call = self._fixed_batches("fit", call, user_batch)
        samples = _num_samples(call.get("x"))
        steps = call.get("steps_per_epoch") or _steps(call.get("x"), samples, call.get("batch_size"))
        self.__dict__["_last_fit"] = (samples, user_batch)
        self._warn_about_traps(steps)
        factor = plan.lr_factor(self._config, self.num_replicas)
        optimizer = self.model.optimizer
        if lr.is_schedule(optimizer):
            warmup = self._config.warmup_epochs
            if warmup and not steps:
                raise ValueError(
                    "warmup_epochs with a LearningRateSchedule ramps per step and needs the "
                    "steps per epoch: pass steps_per_epoch=... to fit (your data has no length)."
                )
            self.__dict__["_lr_scale"] = (factor, warmup * (steps or 0))
        else:
            scaling = lr.LRScaling(optimizer, factor, self._config.warmup_epochs)
            call["callbacks"] = scaling.wrap(call.get("callbacks"))
        if call.get("verbose") not in (0, "0") and environment.process_index() == 0:
            print(self._plan_text(), flush=True)
        call = environment.for_this_process(call)  # several processes: process 0 prints, saves
        return self._engine.run("fit", self.model, call, self._lr_scale)

    def evaluate(self, *args, **kwargs):
        """``keras.Model.evaluate``: every sample exactly once."""
        return self._through_own("evaluate", args, kwargs, self._evaluate)

    def _evaluate(self, *args, **kwargs):
        call = self._bind("evaluate", args, kwargs)
        self._require_compiled("evaluate")
        user_batch = call.get("batch_size")
        call = self._fixed_batches("evaluate", self._globalise(call, ("batch_size",)), user_batch)
        return self._engine.run("evaluate", self.model, environment.for_this_process(call),
                                self._lr_scale)

    def predict(self, *args, **kwargs):
        """``keras.Model.predict``: every sample exactly once, in order."""
        return self._through_own("predict", args, kwargs, self._predict)

    def _predict(self, *args, **kwargs):
        call = self._bind("predict", args, kwargs)
        user_batch = call.get("batch_size")
        call = self._fixed_batches("predict", self._globalise(call, ("batch_size",)), user_batch)
        return self._engine.run("predict", self.model, environment.for_this_process(call),
                                self._lr_scale)

    def train_on_batch(self, *args, **kwargs):
        """``keras.Model.train_on_batch``: one step on every replica, the rows of ``x``
        split over them (the one-device step of this batch, at the user's learning
        rate: the batch policy, LR scaling and warm-up apply to ``fit``). Afterwards the
        user's model holds the new weights and optimizer state."""
        return self._through_own("train_on_batch", args, kwargs, self._train_on_batch)

    def _train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                        return_dict=False):
        self._require_compiled("train_on_batch")
        kwargs = self._on_batch("train_on_batch", x, y, sample_weight)
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError("Arguments `sample_weight` and `class_weight` cannot be "
                                 "specified at the same time: pass one of them.")
            kwargs["sample_weight"] = _class_weights(y, class_weight)
        return self._engine.run("train_on_batch", self.model,
                                dict(kwargs, return_dict=return_dict), (1.0, 0))

    def test_on_batch(self, *args, **kwargs):
        """``keras.Model.test_on_batch``: the loss and metrics of one batch, its rows split
        over the replicas."""
        return self._through_own("test_on_batch", args, kwargs, self._test_on_batch)

    def _test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        self._require_compiled("test_on_batch")
        kwargs = self._on_batch("test_on_batch", x, y, sample_weight)
        return self._engine.run("test_on_batch", self.model,
                                dict(kwargs, return_dict=return_dict), (1.0, 0))

    def predict_on_batch(self, *args, **kwargs):
        """``keras.Model.predict_on_batch``: the rows of ``x`` split over the replicas, the
        predictions in order."""
        return self._through_own("predict_on_batch", args, kwargs, self._predict_on_batch)

    def _predict_on_batch(self, x):
        kwargs = self._on_batch("predict_on_batch", x, None, None)
        return self._engine.run("predict_on_batch", self.model, kwargs, (1.0, 0))

    def _on_batch(self, method, x, y, sample_weight):
        """Checks shared by the ``*_on_batch`` methods: arrays, not a dataset; no stateful
        RNN (refused before anything runs, the model untouched)."""
        if replication.stateful_layers(self.model):
            raise ValueError(
                f"kmgpu: {method} on a model with stateful RNN layers is not supported "
                "(the states of one fixed batch would have to travel per call): use "
                "parallel.fit / evaluate / predict, which carry them, or call the model's "
                f"own parallel.model.{method}(...) on one device.")
        if datasets.is_dataset(x):
            raise TypeError(f"{method}() takes one batch as arrays (x, y), not a "
                            f"{type(x).__name__}: use fit / evaluate / predict for a dataset.")
        if self._engine is None:
            connector.build_from(self.model, x)  # bad x: left to the checks below
        checks._data(self.model, method, x, y, sample_weight,
                     finite=(method != "predict_on_batch"))
        self._connect()
        return dict(x=x) if method == "predict_on_batch" else dict(
            x=x, y=y, sample_weight=sample_weight)

    def reset_states(self):
        """Zero the states of the model's stateful RNN layers (on every replica)."""
        replication.reset_states(self.model)  # the engines take the states from the user's model

    def save(self, filepath, *args, **kwargs):
        """Save the user's model: a plain Keras file, loadable without kmgpu.

        In a multi-process job (kmgpu launch, torchrun, srun) only process 0 writes.
        """
        if environment.process_index() != 0:
            return None
        return self.model.save(filepath, *args, **kwargs)

    def describe(self, samples=None, batch_size=None, print_fn=None):
        """Print the plan, as ``model.summary()`` prints the layers, and return its text
        (for scripts that read it; a notebook shows it once). Without arguments, uses
        the last fit's data size. ``print_fn``: called with the text instead of print
        (``lambda text: None`` prints nothing)."""
        return plan.PlanText.show(self._plan_text(samples, batch_size), print_fn)

    def _plan_text(self, samples=None, batch_size=None):
        if self._engine is None:
            return (f"kmgpu plan\n  {self.model.name} is not built yet: it is built from the "
                    "first batch of the first fit / evaluate / predict, as plain Keras does, "
                    f"and its {self.num_replicas} replica(s) are made then; call describe() "
                    "after that call for the whole plan.")
        if samples is None and batch_size is None and self._last_fit:
            samples, batch_size = self._last_fit
        if batch_size is None:
            batch_size = plan.KERAS_DEFAULT_BATCH
        return plan.describe(backend=self._backend, engine=self._engine,
                             config=self._config, template=self.model,
                             samples=samples, batch_size=batch_size,
                             stateful=self._stateful_text())

    def _stateful_text(self):
        found = replication.stateful_layers(self.model)
        if not found:
            return "none"
        b, n = replication.fixed_batch(self.model), self.num_replicas
        reset = ("zeroed each epoch and each evaluate/predict"
                 if self._config.reset_states == "epoch" else "never zeroed by kmgpu")
        return (f"{len(found)} layer(s), fixed global batch {b}, replica r keeps rows "
                f"r*{b // n}..(r+1)*{b // n}-1; states {reset}; fit does not shuffle")

    def close(self):
        """Release the engine's devices and processes (also done at exit)."""
        if self._engine is not None:
            self._engine.close()

    # -- pass-through -------------------------------------------------------------
    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __setattr__(self, name, value):
        setattr(self.model, name, value)

    def __repr__(self):
        where = (", ".join(self._engine.device_names) if self._engine is not None
                 else "made at the first call (the model is not built yet)")
        return (f"<kmgpu.ParallelModel {self.model.name!r} on {self.num_replicas} "
                f"replica(s): {where}>")

    # -- helpers ------------------------------------------------------------------
    def _through_own(self, method, args, kwargs, dispatch):
        """``dispatch(*args, **kwargs)``, kmgpu's ``method``; for a model whose class has
        its own ``method`` (keras-hub's tasks preprocess first), that method runs on the
        user's model and kmgpu takes over where it calls ``keras.Model``'s
        (``own_methods``), its batch sizes made global first."""
        if not own_methods.overrides(self.model, method):
            return dispatch(*args, **kwargs)
        args, kwargs = own_methods.globalised(self.model, method, args, kwargs,
                                              self._globalise)
        return own_methods.run(self.model, method, args, kwargs,
                               lambda a, k: dispatch(*a, **k))

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
        if self._engine is None:
            connector.build_from(self.model, call.get("x"))  # bad x: left to the checks
        checks.call(method, self.model, call)  # bad input stops here, before the engine
        self._connect()
        return call

    def _connect(self):
        """The engine of a model that was unbuilt when wrapped, now that it is built."""
        if self._engine is None:
            engine = connector.engine_for(self.model, self._config, self._backend)
            _warn_one_device(engine, self._config, stacklevel=5)
            self.__dict__["_engine"] = engine

    def _warn_about_traps(self, steps):
        """Say once when the plan looks like the batch-scaling trap (process 0 only)."""
        if self._warned or environment.process_index() != 0:
            return
        o, n = self._config, self.num_replicas
        text = None
        if o.batch == "per_replica" and not o.scale_lr and n > 1:
            text = (f"batch='per_replica' with scale_lr=False: the global batch is {n}x larger "
                    f"and each epoch takes {n}x fewer steps at the same learning rate, which "
                    "is what made multi_gpu_model models train worse. Use batch='global' "
                    "(the default), or keep per_replica with scale_lr=True (and warmup_epochs).")
        elif steps is not None and steps < 10:
            text = (f"only {steps} step(s) per epoch: with so few updates per epoch the model "
                    "may need more epochs than on one device. A smaller batch_size (it is the "
                    "global batch) gives more steps.")
        if text:
            warnings.warn(f"kmgpu: {text}", stacklevel=3)
            self.__dict__["_warned"] = True

    def _fixed_batches(self, method, call, user_batch):
        """Stateful RNNs need whole, fixed, unshuffled batches that split evenly."""
        if not replication.stateful_layers(self.model):
            return call
        return plan.stateful_call(method, self.model, call, self.num_replicas,
                                     self._config, user_batch)

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
                if size is None and datasets.is_dataset(call.get("x")):
                    continue  # the dataset brings its own batches
                call[key] = plan.global_batch(self._config, size, self.num_replicas)
        return call


def _class_weights(y, class_weight):
    """Per-row weights from ``class_weight``, as Keras's ``train_on_batch`` makes them."""
    import numpy as np

    y = np.asarray(y)
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    y = np.round(y).astype("int32")
    return np.array([class_weight.get(int(c), 1.0) for c in y], dtype="float32")


def _steps(x, samples, global_batch):
    """Steps per epoch of a fit call, or None when the data has no known length."""
    import math

    if samples is not None and global_batch:
        return math.ceil(samples / global_batch)
    try:
        n = len(x)
    except TypeError:
        n = None
    if n is None and hasattr(x, "cardinality"):
        n = int(x.cardinality())
    return n if n is not None and n > 0 else None


def _num_samples(x):
    import keras

    if x is None or datasets.is_dataset(x):
        return None
    leaves = keras.tree.flatten(x)
    return int(leaves[0].shape[0]) if leaves and hasattr(leaves[0], "shape") else None


def rebatch(model, batch_size):
    """A copy of a stateful model with another fixed batch size and the same weights.

    For example ``rebatch(model, 1)`` to predict one sequence step by step after
    training at batch 64. The copy is compiled like ``model`` (with a fresh
    optimizer) when ``model`` is compiled; its states start at zero.

    Args:
        model: a built Sequential or functional ``keras.Model``.
        batch_size: the new fixed batch size, an int >= 1.

    Returns:
        A new ``keras.Model``.
    """
    import keras

    from kmgpu.engines import model_fixes

    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"rebatch(model, batch_size): batch_size must be an int >= 1, "
                        f"got {batch_size!r}.")
    if batch_size < 1:
        raise ValueError(f"rebatch(model, batch_size): batch_size must be >= 1, got {batch_size}.")
    if not isinstance(model, keras.Model):
        raise TypeError(f"rebatch(model, batch_size) takes a keras.Model, got "
                        f"{type(model).__name__}.")
    if not model.built:
        raise ValueError("rebatch(model, batch_size) needs a built model: give it a "
                         "keras.Input(batch_size=...) first.")
    if not model_fixes.is_functional(model):
        raise TypeError(
            f"rebatch needs a Sequential or functional model (its Input fixes the batch); "
            f"{type(model).__name__} is subclassed: create a new instance built for batch "
            f"{batch_size} and copy the weights with new.set_weights(model.get_weights())."
        )
    new = replication.clone_at(model, batch_size)
    new.set_weights(model.get_weights())
    if model.compiled:
        replication.compile_like(new, model)
    return new

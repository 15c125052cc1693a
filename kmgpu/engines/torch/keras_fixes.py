"""Keras internals the torch engine uses or replaces, in one place.

Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
``tests/unit/test_structure.py`` checks every name still exists. Keras 3.15 has no
DDP in its torch trainer (keras master has), so kmgpu's rank step works through the
documented ``train_step`` / ``test_step`` extension points and these few internals.

Private *instance* attributes the torch engine also reads or sets (no module name
to check, so not in ``PATCHES``; look at them when the pin moves): a model's
``_loss_tracker``, ``_call_has_training_arg``, ``_compile_config`` and
``_initial_epoch`` (Keras's fit resumes from it; BackupAndRestore sets it), an
optimizer's ``_learning_rate``, a layer's ``_seed_generators`` and
``_reduction_axes``, ``CallbackList._history``; for the captured step a model's
``train_function`` / ``test_function`` / ``predict_function`` (set to None so Keras
makes them again without torch.compile).
"""

import threading

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.torch.trainer", "TorchTrainer.train_step",
     "compared with the model's own: a model that keeps Keras's step gets kmgpu's DDP "
     "step; one with its own train_step has its gradients averaged in optimizer.apply"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.test_step",
     "compared likewise: Keras's test step is replaced by one that counts only this "
     "rank's real rows in the loss tracker"),
    ("keras.src.backend.torch.trainer", "TorchTrainer._get_metrics_result_or_logs",
     "replaced on each replica: Keras turns metric variables into logs here at epoch "
     "and evaluation ends; kmgpu sums the variables over ranks first (no public hook "
     "sits between the last step and the logs)"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.evaluate",
     "wrapped on each replica so fit's validation and evaluate know their rank slices"),
    ("keras.src.trainers.trainer", "Trainer._compute_loss",
     "kmgpu's steps compute the loss as Keras's own torch steps do"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments",
     "replaced on each replica with sync_batchnorm=True: moments over the global batch "
     "(Keras's torch backend has no synchronised BatchNormalization)"),
    ("keras.src.layers.rnn.rnn", "RNN.call",
     "wrapped on stateful RNN layers of a replica: the torch LSTM/GRU kernels keep the "
     "state variable's tensor for backward and RNN.call then assigns it in place, so a "
     "stateful fit fails with 'modified by an inplace operation' (3.15.1; upstream: no "
     "issue known to kmgpu)"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split",
     "validation_split cut exactly as Keras's fit cuts it"),
    ("keras.src.utils.python_utils", "pythonify_logs",
     "logs as plain Python numbers, to relay them to the driver's callbacks"),
    ("keras.src.utils", "is_default",
     "which hooks a user's callback implements (the test Keras's CallbackList uses)"),
    ("keras.src.backend.torch.core", "convert_to_tensor",
     "its code is swapped while a captured train step runs (graphs.py, "
     "compile(jit_compile=True)): Keras 3.15.1 makes a python scalar or a constant list "
     "a device tensor with torch.as_tensor(x, device=cuda), a blocking copy from "
     "pageable memory that CUDA-graph capture refuses (\"Cannot copy between CPU and "
     "CUDA tensors during CUDA graph capture\": the loss's reduce_values, BatchNorm's "
     "momentum, the optimizer's iterations.assign_add(1) and beta casts); the swap fills "
     "scalars on the device (torch.full) and caches constant lists: the same values "
     "(upstream: no issue known to kmgpu)"),
    ("keras.src.backend.torch.random", "normal",
     "swapped (with uniform, randint, dropout, shuffle, categorical) while kmgpu's torch "
     "train step runs (device_random): Keras 3.15.1 seeds a new torch.Generator with "
     "int(seed) for every SeedGenerator draw, a device-to-host copy CUDA-graph capture "
     "refuses, so Dropout(seed=/noise_shape=), GaussianNoise, the augmentation layers and "
     "keras.random.* broke the capture; the swap draws from the seed state on the device "
     "(rng.py; upstream: no issue known to kmgpu)"),
    ("keras.src.backend.torch.random", "_get_concrete_noise_shape",
     "Dropout's noise shape, as Keras's torch dropout computes it"),
    ("keras.src.layers.preprocessing.image_preprocessing.random_crop",
     "RandomCrop.transform_images",
     "swapped with the random functions: its training crop slices at offset tensors "
     "(a host read each, which capture refuses); kmgpu's crops with index_select on the "
     "device, then Keras's own code runs on the cropped images"),
    ("keras.src.random.seed_generator", "global_seed_generator",
     "seed=None draws from Keras's global SeedGenerator, as draw_seed does"),
    ("keras.src.trainers.trainer", "Trainer.jit_compile",
     "read on a compiled model (graphs.plan): True asks kmgpu's torch engines for the "
     "split step on a CPU too (Keras's meaning, torch.compile, measured 0.73x of eager: "
     "benchmarks/profiles/torch/RESULTS.md); set False on the model that runs kmgpu's step, so Keras "
     "never wraps it in torch.compile"),
    ("keras.src.trainers.epoch_iterator", "EpochIterator",
     "a tf.data.Dataset, generator or DataLoader read on the driver epoch by epoch "
     "exactly as Keras's fit takes it (steps_per_epoch continues one iterator)"),
    ("keras.src.trainers.trainer", "Trainer._symbolic_build",
     "run on the user's model with that iterator, as Keras's fit and evaluate do first: "
     "it builds the compile metrics and, the first time, starts (and drops) one pass"),
]


def _trainer():
    from keras.src.backend.torch.trainer import TorchTrainer

    return TorchTrainer


def has_own_train_step(model):
    """True when ``model``'s class overrides Keras's torch ``train_step``."""
    return type(model).train_step is not _trainer().train_step


def has_own_test_step(model):
    """True when ``model``'s class overrides Keras's torch ``test_step``."""
    return type(model).test_step is not _trainer().test_step


def keras_evaluate(model):
    """Keras's own torch ``evaluate``, bound to ``model`` (to wrap it on the instance)."""
    return _trainer().evaluate.__get__(model)


def read_logs_within(model, context):
    """Make Keras read ``model``'s metric results within ``context()``.

    Keras's torch trainer turns metric variables into logs in
    ``_get_metrics_result_or_logs(logs)`` at every epoch and evaluation end. This
    replaces it on the instance: ``context()`` is a context manager yielding True when
    it changed the variables for the read (then the logs are made plain Python
    numbers before it puts them back).
    """
    read = _trainer()._get_metrics_result_or_logs.__get__(model)

    def get_metrics_result_or_logs(logs):
        with context() as changed:
            out = read(logs)
            if changed and out is logs and isinstance(logs, dict):
                # a step of the user's own returned other keys than model.metrics (the
                # guide's {m.name: m.result()}): what it named after a metric is that
                # metric's result over every rank, not this rank's last step
                results = {m.name: m.result() for m in model.metrics}
                out = {k: results.get(k, v) for k, v in logs.items()}
            return pythonify_logs(out) if changed else out

    model._get_metrics_result_or_logs = get_metrics_result_or_logs


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The loss as Keras's torch steps compute it (``Trainer._compute_loss``)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def global_batch_moments(layer, sum_over_ranks, real_rows):
    """Replace a BatchNormalization layer's ``_moments`` by moments over the global batch.

    Args:
        layer: a ``keras.layers.BatchNormalization`` of a replica.
        sum_over_ranks: a differentiable all-reduce (sum) of one tensor.
        real_rows: ``real_rows()`` is the number of real rows of this rank's batch
            inside a train step, None outside one (then the layer's own moments).
    """
    import numpy as np
    import torch

    local = layer._moments

    def moments(inputs, mask):
        n_real = real_rows()
        if n_real is None:
            return local(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs[:n_real]
        if mask is None:
            count = float(np.prod([x.shape[a] for a in axes]))
            s1 = torch.sum(x, dim=axes)
            s2 = torch.sum(x * x, dim=axes)
            n = torch.full_like(s1, count)
        else:
            w = mask[:n_real].to(x.dtype)
            w = torch.broadcast_to(w.unsqueeze(-1), x.shape)
            s1 = torch.sum(x * w, dim=axes)
            s2 = torch.sum(x * x * w, dim=axes)
            n = torch.sum(w, dim=axes)
        total = sum_over_ranks(torch.stack([s1, s2, n]))
        mean = total[0] / total[2]
        variance = total[1] / total[2] - mean * mean
        return mean, variance

    layer._moments = moments


def copy_states_in(layer):
    """Run a stateful RNN layer from a copy of its states (this replica only).

    Keras 3.15's torch LSTM and GRU kernels (``backend.lstm`` / ``backend.gru``,
    which bypass ``RNN.inner_loop``'s own copy) multiply by the state variable's
    tensor itself, so autograd saves it; ``RNN.call`` then ``assign``s the new
    states into that tensor in place and ``backward`` fails ("modified by an
    inplace operation"). Given a copy as ``initial_state``, the layer computes
    the same and its own assign still carries the states to the next batch.
    """
    import keras

    call = layer.call

    def call_from_copy(sequences, initial_state=None, **kwargs):
        if initial_state is None:
            initial_state = keras.tree.map_structure(lambda v: v.value.clone(), layer.states)
        return call(sequences, initial_state=initial_state, **kwargs)

    layer.call = call_from_copy


def train_validation_split(arrays, validation_split):
    """Keras's own cut of (x, y, sample_weight) for ``validation_split``.

    Returns:
        ((x, y, sample_weight) to train on, (x, y, sample_weight) to validate on).
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def pythonify_logs(logs):
    """Keras's logs with tensors turned into Python numbers."""
    from keras.src.utils.python_utils import pythonify_logs as pythonify

    return pythonify(logs)


def is_default(method):
    """True when a callback's hook is Keras's own do-nothing default."""
    from keras.src import utils

    return utils.is_default(method)


def epoch_iterator(x, steps_per_epoch=None, build=None):
    """Keras's own ``EpochIterator`` over a dataset (NumPy batches), made as fit makes
    it: ``build``'s symbolic build first (a model: fit and evaluate; None: predict),
    then reset. Iterating it once gives one epoch's batches as ``(step, step, [batch])``.
    """
    from keras.src.trainers.epoch_iterator import EpochIterator

    iterator = EpochIterator(x=x, steps_per_epoch=steps_per_epoch)
    if build is not None:
        build._symbolic_build(iterator=iterator)
    iterator.reset()
    return iterator


# -- the captured step (graphs.py) --------------------------------------------------------
_SWAP = {"code": None, "kwdefaults": None}
_CONSTANTS = {}
_CONSTANTS_MAX = 1024


def _device_scalar(x, dtype=None, sparse=None, ragged=None, *, _original=None, _torch=None,
                   _to_dtype=None, _floatx=None, _device=None, _constants=None, _limit=0):
    """What ``convert_to_tensor`` runs inside ``device_scalars()``: the same values,
    made on the device without a host copy. It runs with Keras's module globals, so
    everything it needs comes in through its keyword-only defaults."""
    kind = type(x)
    if sparse or ragged:
        return _original(x, dtype, sparse, ragged)
    if kind is bool or kind is int or kind is float:
        device = _device()
        if str(device) == "meta":
            return _original(x, dtype, sparse, ragged)
        if dtype is not None:
            dt = _to_dtype(dtype)
        elif kind is bool:
            dt = _torch.bool
        elif kind is int:
            dt = _torch.int64 if x < -(2**31) or x >= 2**31 else _torch.int32
        else:
            dt = _to_dtype(_floatx())
        return _torch.full((), x, dtype=dt, device=device)
    if (kind is tuple or kind is list) and x and all(
            type(e) is int or type(e) is float or type(e) is bool for e in x):
        key = (kind, tuple(x), tuple(type(e) for e in x), str(dtype), str(_device()))
        made = _constants.get(key)
        if made is None:
            made = _original(x, dtype, sparse, ragged)
            if len(_constants) >= _limit:
                return made
            _constants[key] = made
        return made.clone()  # a device copy: capturable, and the cache stays unmutated
    return _original(x, dtype, sparse, ragged)


def _swap_in():
    import types

    import torch
    from keras.src.backend.config import floatx
    from keras.src.backend.torch import core

    f = core.convert_to_tensor
    original = types.FunctionType(f.__code__, f.__globals__, "convert_to_tensor",
                                  f.__defaults__, f.__closure__)
    _SWAP["code"], _SWAP["kwdefaults"] = f.__code__, f.__kwdefaults__
    f.__code__ = _device_scalar.__code__
    f.__kwdefaults__ = dict(_original=original, _torch=torch, _to_dtype=core.to_torch_dtype,
                            _floatx=floatx, _device=core.get_device, _constants=_CONSTANTS,
                            _limit=_CONSTANTS_MAX)


def _swap_out():
    from keras.src.backend.torch import core

    f = core.convert_to_tensor
    f.__code__, f.__kwdefaults__ = _SWAP["code"], _SWAP["kwdefaults"]
    _SWAP["code"] = _SWAP["kwdefaults"] = None


class _Swap:
    """Re-entrant, thread-safe: swap_in() as the outer block opens, swap_out() as it ends."""

    def __init__(self, swap_in, swap_out):
        self._in, self._out, self._depth, self._lock = swap_in, swap_out, 0, threading.Lock()

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._in()
            self._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._out()
        return False


_SCALARS = _Swap(_swap_in, _swap_out)


def device_scalars():
    """Within the block, Keras's torch ``convert_to_tensor`` makes python scalars on
    the device (``torch.full``) and constant lists once (then a device copy each
    call), so a step has no host-to-device copy and can be captured as a CUDA
    graph; the values are Keras's own. The function's code object is swapped (not
    the module attribute: Keras's modules import it by name). Re-entrant."""
    return _SCALARS


def wants_captured_step(model):
    """True for a model compiled with ``jit_compile=True`` (on torch: kmgpu's split step
    on a CPU too), read before the engine sets the flag False on the model that runs it."""
    return bool(getattr(model, "compiled", False)) and model.jit_compile is True


def set_jit_compile(model, value):
    """Set ``model.jit_compile`` and drop Keras's cached step functions, so the next
    fit / evaluate / predict makes them again with this setting."""
    model.jit_compile = value
    model.train_function = model.test_function = model.predict_function = None


# -- random layers inside the captured step (graphs.py) ----------------------------------
_RANDOM = {"made": None}


def _draw_key(seed, device):
    """Keras's ``draw_seed``, on the device: the key of one draw, (k0, k1).

    A ``SeedGenerator`` (a layer's, or Keras's global one for ``seed=None``) gives its
    state, advanced on the device (``state[1] += 1``; ``SeedGenerator.next`` copies a
    numpy increment from the host); an int seed gives the same key every call, as in Keras.
    """
    import torch
    from keras.src.random.seed_generator import SeedGenerator, global_seed_generator

    if seed is None:
        seed = global_seed_generator()
    if isinstance(seed, SeedGenerator):
        state = seed.state.value
        drawn = state.to(device=device, dtype=torch.int64)  # a copy
        with torch.no_grad():
            state[1:].add_(1)
        return drawn[0], drawn[1]
    if isinstance(seed, int):
        return seed & 0xFFFFFFFF, 0
    raise ValueError(f"Argument `seed` must be an integer or a SeedGenerator, not {seed!r}")


def _random_functions():
    """Keras's torch random functions that draw with a generator, computed with
    ``rng`` from a device key instead (same signatures, same distributions)."""
    import math

    import torch
    from keras.src.backend.config import floatx
    from keras.src.backend.torch import core
    from keras.src.backend.torch import random as keras_random
    from keras.src.random.seed_generator import SeedGenerator

    from kmgpu.engines.torch import rng

    original = {name: getattr(keras_random, name) for name in
                ("normal", "uniform", "randint", "dropout", "shuffle", "categorical")}

    def draw(kind, shape, seed, dtype):
        device = core.get_device()
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape)
        out = getattr(rng, kind)(n, _draw_key(seed, device), device)
        return out.reshape(shape).to(dtype)

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        if core.get_device() == "meta":
            return original["normal"](shape, mean, stddev, dtype, seed)
        dtype = core.to_torch_dtype(dtype or floatx())
        return draw("normal", shape, seed, torch.float32).mul_(stddev).add_(mean).to(dtype)

    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        if core.get_device() == "meta":
            return original["uniform"](shape, minval, maxval, dtype, seed)
        u = draw("uniform", shape, seed, core.to_torch_dtype(dtype or floatx()))
        return (maxval - minval) * u + minval

    def randint(shape, minval, maxval, dtype="int32", seed=None):
        if core.get_device() == "meta":
            return original["randint"](shape, minval, maxval, dtype, seed)
        device = core.get_device()
        shape = tuple(int(d) for d in shape)
        h = rng.bits(math.prod(shape), _draw_key(seed, device), device)
        out = minval + ((h * (maxval - minval)) >> 32)
        return out.reshape(shape).to(core.to_torch_dtype(dtype))

    def dropout(inputs, rate, noise_shape=None, seed=None):
        unseeded = seed is None or isinstance(seed, SeedGenerator) and seed._initial_seed is None
        if rate in (0.0, 1.0) or (unseeded and noise_shape is None) or \
                core.get_device() == "meta":  # Keras's own: torch's dropout, capturable
            return original["dropout"](inputs, rate, noise_shape, seed)
        keep = 1.0 - rate
        shape = keras_random._get_concrete_noise_shape(inputs, noise_shape)
        mask = draw("uniform", shape, seed, torch.float32) < keep
        mask = torch.broadcast_to(mask, inputs.shape)
        return torch.where(mask, inputs / keep, torch.zeros_like(inputs, dtype=inputs.dtype))

    def shuffle(x, axis=0, seed=None):
        x = core.convert_to_tensor(x)
        if core.get_device() == "meta":
            return original["shuffle"](x, axis, seed)
        perm = draw("uniform", x.shape[:axis + 1], seed, torch.float32).argsort(axis)
        for _ in range(x.ndim - axis - 1):
            perm = perm.unsqueeze(-1)
        perm = perm.repeat(*[1] * (axis + 1), *x.shape[axis + 1:])
        return x.gather(axis, perm)

    def categorical(logits, num_samples, dtype="int32", seed=None):
        logits = core.convert_to_tensor(logits)
        if core.get_device() == "meta":
            return original["categorical"](logits, num_samples, dtype, seed)
        # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits)
        shape = tuple(logits.shape[:-1]) + (int(num_samples), int(logits.shape[-1]))
        u = draw("uniform", shape, seed, torch.float32).clamp_(1e-7, 1 - 1e-7)
        gumbel = -torch.log(-torch.log(u))
        scores = torch.log_softmax(logits.float(), dim=-1).unsqueeze(-2) + gumbel
        return scores.argmax(-1).to(core.to_torch_dtype(dtype))

    from keras.src.layers.preprocessing.image_preprocessing.random_crop import RandomCrop

    crop = RandomCrop.transform_images

    def crop_images(self, images, transformation, training=True):
        """RandomCrop's training crop at a device offset: ``index_select``, where Keras
        slices with the offset tensors (a host read of each)."""
        h0, w0 = transformation
        if training and torch.is_tensor(h0) and torch.is_tensor(images):
            images = self.backend.cast(images, self.compute_dtype)
            for axis, size, start in ((self.height_axis, self.height, h0),
                                      (self.width_axis, self.width, w0)):
                where = torch.arange(size, device=images.device) + start.to(
                    device=images.device, dtype=torch.int64)
                images = images.index_select(images.ndim + axis, where)
            transformation = (0, 0)
        return crop(self, images, transformation, training)

    patched = dict(normal=normal, uniform=uniform, randint=randint, dropout=dropout,
                   shuffle=shuffle, categorical=categorical)
    return [(keras_random, name, original[name], fn) for name, fn in patched.items()] + [
        (RandomCrop, "transform_images", crop, crop_images)]


def _swap_random(use):
    _RANDOM["made"] = _RANDOM["made"] or _random_functions()
    for owner, name, keras_fn, device_fn in _RANDOM["made"]:
        setattr(owner, name, device_fn if use else keras_fn)


_RANDOMS = _Swap(lambda: _swap_random(True), lambda: _swap_random(False))


def device_random():
    """Within the block, Keras's torch random functions (``normal``, ``uniform``,
    ``randint``, ``dropout`` with a seed or noise_shape, ``shuffle``, ``categorical``;
    ``truncated_normal`` calls ``normal``) draw from the seed generator's device state
    (``rng``), with nothing copied to the host, so the layers that use them
    (``Dropout``, ``GaussianNoise``, ``GaussianDropout``, ``AlphaDropout``,
    ``SpatialDropout``, the augmentation layers, ``keras.random.*``) can be captured;
    ``RandomCrop`` crops at its device offsets. Module attributes are swapped (Keras
    calls them as ``backend.random.<name>``).
    Re-entrant."""
    return _RANDOMS

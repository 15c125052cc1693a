"""Keras's torch code that CUDA-graph capture refuses, made capturable while kmgpu's step
runs: python scalars and constants made on the device (``device_scalars``), random draws
from the seed state on the device (``device_random``), the metrics' segment sums,
scatters and ``max(initial=)`` without a host read; and the ``jit_compile`` flag that asks
for the captured step. Rows of ``kmgpu/engines/torch/keras_fixes.py``.
"""

from kmgpu.engines import keras_fixes

_CONSTANTS = {}
_CONSTANTS_MAX = 1024
_ARRAY_MAX = 1 << 16  # elements of a numpy constant kept on the device (by content)


def _device_scalar(x, dtype=None, sparse=None, ragged=None, *, _original=None, _torch=None,
                   _to_dtype=None, _floatx=None, _device=None, _constants=None, _limit=0,
                   _np=None, _array_limit=0):
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
    key = None
    if isinstance(x, (tuple, list)) and x and all(  # Keras's TrackedList too (BinaryIoU)
            type(e) is int or type(e) is float or type(e) is bool for e in x):
        key = (kind, tuple(x), tuple(type(e) for e in x), str(dtype), str(_device()))
    elif (kind is _np.ndarray or isinstance(x, _np.generic)) and x.size <= _array_limit and \
            x.dtype.kind in "biuf":  # AUC's thresholds, np.where(...) results: by content
        key = ("np", x.dtype.str, x.shape, x.tobytes(), str(dtype), str(_device()))
    if key is not None:  # a constant: made once, then a device copy per call
        made = _constants.get(key)
        if made is None:
            made = _original(x, dtype, sparse, ragged)
            if len(_constants) >= _limit:
                return made
            _constants[key] = made
        return made.clone()  # capturable, and the cache stays unmutated
    return _original(x, dtype, sparse, ragged)


def _scalar_defaults(f):
    """``_device_scalar``'s keyword-only defaults for Keras's ``convert_to_tensor`` ``f``,
    whose own code (unswapped) comes in as ``_original``."""
    import types

    import numpy as np
    import torch
    from keras.src.backend.config import floatx
    from keras.src.backend.torch import core

    original = types.FunctionType(f.__code__, f.__globals__, "convert_to_tensor",
                                  f.__defaults__, f.__closure__)
    return dict(_original=original, _torch=torch, _to_dtype=core.to_torch_dtype,
                _floatx=floatx, _device=core.get_device, _constants=_CONSTANTS,
                _limit=_CONSTANTS_MAX, _np=np, _array_limit=_ARRAY_MAX)


def device_scalars():
    """Within the block, Keras's torch ``convert_to_tensor`` makes python scalars on
    the device (``torch.full``) and constant lists once (then a device copy each
    call), so a step has no host-to-device copy and can be captured as a CUDA
    graph; the values are Keras's own. The function's code object is swapped (not
    the module attribute: Keras's modules import it by name), its keyword-only
    defaults first (the code Keras's function has never reads them). Re-entrant."""
    from keras.src.backend.torch import core

    f = core.convert_to_tensor
    return keras_fixes.swapped((f, "__kwdefaults__", lambda keras_own: _scalar_defaults(f)),
                               (f, "__code__", lambda keras_own: _device_scalar.__code__))


def wants_captured_step(model):
    """True for a model compiled with ``jit_compile=True`` (on torch: kmgpu's split step
    on a CPU too), read before the engine sets the flag False on the model that runs it."""
    return bool(getattr(model, "compiled", False)) and model.jit_compile is True


def set_jit_compile(model, value):
    """Set ``model.jit_compile`` and drop Keras's cached step functions, so the next
    fit / evaluate / predict makes them again with this setting."""
    model.jit_compile = value
    model.train_function = model.test_function = model.predict_function = None


# -- random layers inside the captured step (capture/graphs.py) --------------------------
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

    from kmgpu.engines.torch.capture import rng

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
    return [(keras_random, name, fn) for name, fn in patched.items()] + [
        (RandomCrop, "transform_images", crop_images)] + _metric_functions()


def _metric_functions():
    """Keras's torch ``segment_sum``'s helper, ``scatter`` (the confusion-matrix
    metrics: AUC, Precision/Recall at thresholds, MeanIoU ...) and ``max`` with
    ``initial`` (the metrics at a fixed recall, precision, sensitivity or specificity),
    the same values as device ops without a host read."""
    import torch
    from keras.src.backend.torch import core
    from keras.src.backend.torch import math as keras_math
    from keras.src.backend.torch import numpy as keras_numpy

    segment = keras_math._segment_reduction_fn
    scatter = core.scatter
    keras_max = keras_numpy.max

    def max_(x, axis=None, keepdims=False, initial=None):
        x = core.convert_to_tensor(x)
        if initial is None or 0 in x.shape or core.get_device() == "meta":
            return keras_max(x, axis=axis, keepdims=keepdims, initial=initial)
        result = keras_max(x, axis=axis, keepdims=keepdims)
        initial = core.convert_to_tensor(initial, dtype=result.dtype)
        return torch.maximum(result, initial)

    def segment_reduction(data, segment_ids, reduction_method, num_segments):
        if num_segments is None or core.get_device() == "meta":
            return segment(data, segment_ids, reduction_method, num_segments)
        # Keras: repeat_interleave by a device count (a host read on CUDA) and
        # torch.tensor(shape, device=...) (a blocking copy); here a broadcast
        ids = segment_ids.reshape((-1,) + (1,) * (data.ndim - 1)).to(torch.int64)
        ids = torch.where((ids >= 0) & (ids < num_segments), ids, num_segments)
        ids = ids.expand(data.shape)
        fill = {"amax": -float("inf"), "amin": float("inf"), "prod": 1.0}.get(
            reduction_method, 0.0)
        result = torch.full((num_segments + 1,) + tuple(data.shape[1:]), fill,
                            device=data.device)
        result = result.scatter_reduce(0, ids, data.float(), reduction_method)
        return result[:-1, ...].type(data.dtype)

    def scatter_(indices, values, shape):
        indices, values = core.convert_to_tensor(indices), core.convert_to_tensor(values)
        if core.get_device() == "meta":
            return scatter(indices, values, shape)
        shape = tuple(int(d) for d in shape)
        zeros = torch.zeros(shape, dtype=values.dtype, device=values.device)
        n = indices.shape[-1]
        indices = indices.reshape(-1, n).to(torch.int64)
        values = values.reshape((-1,) + shape[n:])
        # Keras adds row by row (zeros[tuple(index)] += value: a launch per row)
        return zeros.index_put_(tuple(indices.T), values, accumulate=True)

    return [(keras_math, "_segment_reduction_fn", segment_reduction),
            (core, "scatter", scatter_), (keras_numpy, "max", max_)]


_RANDOM = {"swaps": None}  # device_random's swaps, made at its first block


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
    if _RANDOM["swaps"] is None:
        _RANDOM["swaps"] = [(owner, name, lambda keras_own, fn=device_fn: fn)
                            for owner, name, device_fn in _random_functions()]
    return keras_fixes.swapped(*_RANDOM["swaps"])

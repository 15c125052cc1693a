"""Input checks: a bad argument is refused here, before any engine sees it.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind,
wrong value) with a message that says what to pass instead. Nothing here changes the
user's model, starts a worker or touches a device, so a refused call leaves the model
byte-identical (weights, config, optimizer state). ``api.py`` calls ``compile_args``
before ``model.compile`` and ``call`` before ``engine.run``.

Data given as a dataset (tf.data, ``keras.utils.PyDataset``, a generator, a torch
DataLoader) is passed through: only the engine can read it.
"""

import inspect
import math
import numbers

import numpy as np

from kmgpu.engines import datasets

_VERBOSE = ("auto", 0, 1, 2)
_SPECIAL_METRICS = ("accuracy", "acc", "crossentropy", "ce")
_SCAN_ELEMENTS = 1 << 22  # rows are scanned for NaN/inf in blocks of about this size


# -- compile ---------------------------------------------------------------------------
def check_model(model):
    """Raise TypeError unless ``model`` is a built Keras model kmgpu can re-create."""
    import keras

    from kmgpu.engines import model_fixes

    model_fixes.serialize_without_tensorflow()
    if not isinstance(model, keras.Model):
        what = type(model).__name__
        hint = " Wrap your layer in keras.Sequential([...]) first." if isinstance(
            model, keras.layers.Layer
        ) else ""
        raise TypeError(f"kmgpu.parallelize needs a keras.Model, got a {what}.{hint}")
    if not model.built:
        raise ValueError(
            "kmgpu.parallelize needs a built model: give it an Input(shape=...), or call "
            "model.build(input_shape) or model(x) once before wrapping it."
        )
    try:
        model.get_config()
    except NotImplementedError:
        raise TypeError(
            f"{type(model).__name__} has no get_config(): kmgpu re-creates the model on "
            "each device from its config. Implement get_config() (and from_config() if "
            "__init__ takes non-serialisable arguments) on your subclassed model."
        ) from None


def compile_args(model, args, kwargs):
    """Check ``ParallelModel.compile(*args, **kwargs)`` before the model is touched."""
    import keras

    try:
        bound = inspect.signature(keras.Model.compile).bind(model, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"ParallelModel.compile(): {e}. It takes the arguments of "
                        "keras.Model.compile.") from None
    a = bound.arguments
    _optimizer(a.get("optimizer", "rmsprop"))
    _identifiers("loss", a.get("loss"), keras.losses.get, keras.losses.Loss,
                 "a loss name such as 'mse', a keras.losses.Loss or a function "
                 "(y_true, y_pred)")
    for key in ("metrics", "weighted_metrics"):
        _identifiers(key, a.get(key), keras.metrics.get, keras.metrics.Metric,
                     "a metric name such as 'mae', a keras.metrics.Metric or a function "
                     "(y_true, y_pred)", special=_SPECIAL_METRICS)
    steps = a.get("steps_per_execution", 1)
    _int_at_least("steps_per_execution", steps, 1, "(1 runs one batch per step)")
    lw = a.get("loss_weights")
    if lw is not None:
        for leaf in keras.tree.flatten(lw):
            if isinstance(leaf, bool) or not isinstance(leaf, numbers.Real):
                raise TypeError(f"loss_weights holds {leaf!r}: pass numbers, one per output "
                                "(a list, or a dict keyed by output name).")


def _optimizer(optimizer):
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        return
    try:
        if isinstance(optimizer, str) and keras.optimizers.get(optimizer) is not None:
            return
    except ValueError:
        pass
    raise ValueError(f"optimizer={optimizer!r} is not an optimizer: pass a name such as "
                     "'adam' or 'sgd', or an instance such as keras.optimizers.Adam(1e-3).")


def _identifiers(key, value, get, cls, what, special=()):
    import keras

    if value is None:
        return
    for leaf in keras.tree.flatten(value):
        if leaf is None or isinstance(leaf, cls):
            continue
        if isinstance(leaf, str):
            if leaf.lower() in special:
                continue
            try:
                if get(leaf) is not None:
                    continue
            except ValueError:
                pass
            raise ValueError(f"{key}: Keras does not know {leaf!r}. Pass {what}.")
        if not callable(leaf):
            raise TypeError(f"{key} holds a {type(leaf).__name__} ({leaf!r}). Pass {what}.")


# -- fit / evaluate / predict ----------------------------------------------------------
def call(method, model, call):
    """Check the keyword arguments of a ``fit`` / ``evaluate`` / ``predict`` call.

    Args:
        method: "fit", "evaluate" or "predict".
        model: the user's model (read only).
        call: the call's arguments, bound to ``keras.Model.<method>``'s signature,
            batch sizes as the user gave them.
    """
    if call.get("verbose", "auto") not in _VERBOSE or isinstance(call.get("verbose"), bool):
        raise ValueError(f"verbose={call.get('verbose')!r}: pass 'auto', 0 (silent), "
                         "1 (progress bar) or 2 (one line per epoch).")
    for key in ("batch_size", "validation_batch_size", "steps", "steps_per_epoch",
                "validation_steps"):
        if call.get(key) is not None:
            _int_at_least(key, call[key], 1, "or leave it out")
    _callbacks(call.get("callbacks"))
    x, y, sw = call.get("x"), call.get("y"), call.get("sample_weight")
    if method == "fit":
        _fit_numbers(call)
    # NaN/inf: scanned where they would train the weights (fit: x, y, sample_weight) and in
    # evaluate's (and fit's validation_data's) y and sample_weight (one value or row per
    # sample). evaluate's, predict's and validation_data's x is not scanned: it trains
    # nothing, a NaN there shows in the metrics or predictions as in plain Keras, and the
    # scan of a large x (images) would cost evaluate more than the host work of the
    # evaluation itself on a GPU
    n = _data(model, method, x, y if method != "predict" else None,
              sw if method != "predict" else None,
              finite={"fit": True, "evaluate": "labels"}.get(method, False))
    if method != "fit":
        return
    split = call.get("validation_split") or 0.0
    if split:
        if n is None:
            raise ValueError("validation_split cuts the last rows off arrays; x is a dataset. "
                             "Pass validation_data=... instead.")
        train = int(math.floor(n * (1.0 - split)))
        if train < 1 or train >= n:
            raise ValueError(
                f"validation_split={split} leaves {train} of {n} samples for training and "
                f"{n - train} for validation: pick a split that leaves at least one sample "
                "on each side, or pass validation_data=... instead.")
    vd = call.get("validation_data")
    if vd is not None and not datasets.is_dataset(vd):
        if not isinstance(vd, (tuple, list)) or not 2 <= len(vd) <= 3:
            raise ValueError(
                "validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val) "
                f"or a dataset; got a {type(vd).__name__}"
                + (f" of {len(vd)} items" if isinstance(vd, (tuple, list)) else "") + ".")
        _data(model, "fit", vd[0], vd[1], vd[2] if len(vd) == 3 else None, finite="labels",
              names=("validation x", "validation y", "validation sample_weight"))


def _fit_numbers(call):
    epochs = call.get("epochs", 1)
    _int_at_least("epochs", epochs, 1, "(the number of passes over the data)")
    initial = call.get("initial_epoch", 0)
    _int_at_least("initial_epoch", initial, 0, "(0 starts from the first epoch)")
    if initial >= epochs:
        raise ValueError(
            f"initial_epoch={initial} with epochs={epochs} trains nothing: epochs is the "
            f"index of the last epoch, not a count. Pass epochs > {initial}, e.g. "
            f"epochs={initial + 1}.")
    split = call.get("validation_split", 0.0)
    if isinstance(split, bool) or not isinstance(split, numbers.Real) or not 0 <= split < 1:
        raise ValueError(f"validation_split={split!r}: pass a fraction in [0, 1), such as 0.2 "
                         "(the last 20% of the samples), or 0 for none.")
    freq = call.get("validation_freq", 1)
    _int_at_least("validation_freq", freq, 1, "(validate every N epochs)")
    shuffle = call.get("shuffle", True)
    if not isinstance(shuffle, bool) and shuffle != "batch":
        raise TypeError(f"shuffle={shuffle!r}: pass True, False or 'batch'.")
    cw = call.get("class_weight")
    if cw is not None and not isinstance(cw, dict):
        raise TypeError(f"class_weight must be a dict {{class index: weight}}, not "
                        f"{type(cw).__name__}.")


def _int_at_least(key, value, low, hint=""):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{key}={value!r}: pass an int >= {low} {hint}".rstrip() + ".")
    if value < low:
        raise ValueError(f"{key}={value!r}: pass an int >= {low} {hint}".rstrip() + ".")


def _callbacks(callbacks):
    import keras

    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback instances, "
                        f"not a {type(callbacks).__name__}: pass e.g. "
                        "callbacks=[keras.callbacks.EarlyStopping()].")
    for cb in callbacks:
        if not isinstance(cb, keras.callbacks.Callback):
            hint = " (a class: instantiate it)" if isinstance(cb, type) else ""
            raise TypeError(f"callbacks holds {cb!r}{hint}: pass keras.callbacks.Callback "
                            "instances, e.g. callbacks=[keras.callbacks.EarlyStopping()].")


def _data(model, method, x, y, sw, finite, names=("x", "y", "sample_weight")):
    """Check arrays; return the number of samples (None for a dataset)."""
    import keras

    if x is None:
        raise ValueError(f"{method}() got {names[0]}=None: pass the input data (a NumPy "
                         "array, a list or dict of arrays for several inputs, or a dataset).")
    if datasets.is_dataset(x):
        if y is not None:
            raise ValueError(f"{names[0]} is a dataset, which yields (x, y) batches itself: "
                             f"leave {names[1]} out.")
        return None
    parts = []
    for name, value in zip(names, (x, y, sw)):
        if value is None:
            continue
        if isinstance(value, (str, bytes)):
            raise TypeError(f"{name} is a {type(value).__name__} ({value[:40]!r}): pass the "
                            "data itself as an array (load the file first, e.g. np.load).")
        if datasets.is_dataset(value):
            raise TypeError(f"{name} is a {type(value).__name__} while {names[0]} holds "
                            "arrays: pass arrays for both, or a dataset that yields (x, y) "
                            f"as {names[0]} alone.")
        flat = keras.tree.flatten(value) if isinstance(value, (list, tuple, dict)) else [value]
        paths = _paths(name, value)
        for path, leaf in zip(paths, flat):
            if leaf is None:
                continue
            shape = getattr(leaf, "shape", None)
            if shape is None:
                raise TypeError(f"{path} holds a {type(leaf).__name__} where an array was "
                                f"expected: pass np.asarray(...) of shape (samples, ...).")
            if len(shape) == 0:
                raise ValueError(f"{path} is a scalar: pass an array with one row per sample.")
            parts.append((path, leaf))
    rows = {path: int(leaf.shape[0]) for path, leaf in parts}
    n = rows[parts[0][0]]
    if len(set(rows.values())) > 1:
        sizes = ", ".join(f"{p}: {r}" for p, r in rows.items())
        raise ValueError(f"the arrays of one {method}() call must have the same number of "
                         f"samples (rows), got {sizes}: pass one row per sample in each.")
    if n == 0:
        raise ValueError(f"{names[0]} has no samples (0 rows): pass at least one sample.")
    for path, leaf in parts:
        _dtype(path, leaf)
    _features(model, x, names[0])
    if finite:
        for path, leaf in parts:
            if finite is True or not path.startswith(names[0]):  # "labels": y, sample_weight
                _finite(path, leaf)
    return n


def _paths(name, value):
    import keras

    if isinstance(value, dict):
        keys = sorted(value)  # keras.tree.flatten orders dict keys
        return [f"{name}[{k!r}]" for k in keys]
    if isinstance(value, (list, tuple)):
        return [f"{name}[{i}]" for i in range(len(keras.tree.flatten(value)))]
    return [name]


def _dtype(path, leaf):
    from keras import backend

    dtype = getattr(leaf, "dtype", None)
    if dtype is None:  # e.g. a pandas DataFrame
        dtype = np.asarray(leaf).dtype
    try:
        backend.standardize_dtype(dtype)
    except (ValueError, TypeError):
        raise TypeError(f"{path} has dtype {dtype}, which Keras cannot train on: convert it "
                        "to numbers first (e.g. x.astype('float32'); encode strings and "
                        "categories as integers).") from None


def _features(model, x, name):
    """Per-sample shapes of x against the model's Input shapes (where it has them)."""
    import keras

    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return
    if not inputs:
        return
    specs = keras.tree.flatten(inputs)
    if isinstance(x, dict):
        by_name = {getattr(s, "name", None): s for s in specs}
        pairs = [(f"{name}[{k!r}]", v, by_name[k]) for k, v in x.items() if k in by_name]
    else:
        leaves = keras.tree.flatten(x) if isinstance(x, (list, tuple)) else [x]
        if len(leaves) != len(specs):
            return
        paths = _paths(name, x)
        pairs = list(zip(paths, leaves, specs))
    for path, leaf, spec in pairs:
        if leaf is None or getattr(spec, "shape", None) is None:
            continue
        want, got = tuple(spec.shape[1:]), tuple(int(d) for d in leaf.shape[1:])
        if not _compatible(want, got):
            shown = ", ".join("any" if d is None else str(d) for d in want)
            raise ValueError(
                f"{path} has per-sample shape {got} (array shape {tuple(leaf.shape)}), but "
                f"the model's input {getattr(spec, 'name', '')!r} takes ({shown}): pass an "
                f"array of shape (samples, {shown}), or rebuild the model for this data.")


def _compatible(want, got):
    def same(a, b):
        return len(a) == len(b) and all(w is None or w == g for w, g in zip(a, b))

    if same(want, got):
        return True
    # Keras adds or drops one trailing axis of size 1 on its own
    if want and want[-1] == 1 and same(want[:-1], got):
        return True
    return bool(got) and got[-1] == 1 and same(want, got[:-1])


def _host(leaf):
    if isinstance(leaf, np.ndarray):
        return leaf
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # torch tensor
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


def _finite(path, leaf):
    """NaN or inf in float data: refused, with the rows that hold them."""
    from keras import backend

    dtype = backend.standardize_dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
    if "float" not in dtype and "complex" not in dtype:
        return
    arr = _host(leaf)
    n = arr.shape[0]
    per_row = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)))
    step = max(1, _SCAN_ELEMENTS // per_row)
    if _all_finite(arr, step):
        return
    for lo in range(0, n, step):
        block = np.asarray(arr[lo:lo + step])
        ok = np.isfinite(block)
        if ok.all():
            continue
        bad = ~ok.reshape(len(block), -1).all(axis=1)
        first = lo + int(np.argmax(bad))
        total = int(bad.sum()) + sum(
            int((~np.isfinite(np.asarray(arr[j:j + step])).reshape(
                min(step, n - j), -1).all(axis=1)).sum())
            for j in range(lo + step, n, step))
        what = "NaN" if np.isnan(block).any() else "inf"
        raise ValueError(
            f"{path} holds {what} values in {total} of {n} rows (first: row {first}). "
            "They would turn the weights (or the metrics) into NaN: drop those rows, or "
            "fill them in (np.nan_to_num, or an imputer), before calling.")


def _all_finite(arr, step):
    """Whether every value is finite, the blocks scanned on several threads (NumPy lets
    go of the GIL: the scan is memory-bound, and on one core a sizeable share of a fast
    GPU epoch's time per row, paid at every fit / evaluate call)."""
    import concurrent.futures
    import os

    blocks = range(0, arr.shape[0], step)
    threads = min(len(blocks), os.cpu_count() or 1, 8)
    if threads < 2:
        return all(np.isfinite(np.asarray(arr[lo:lo + step])).all() for lo in blocks)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return all(pool.map(lambda lo: bool(np.isfinite(np.asarray(arr[lo:lo + step])).all()),
                            blocks))

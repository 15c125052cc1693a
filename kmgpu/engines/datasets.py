"""What a dataset is: the one rule every part of kmgpu uses (the input checks, the
front's batch handling and each engine's data feeds)."""

import numbers


def is_dataset(x):
    """True for data that brings its own batches (a ``tf.data.Dataset``, a
    ``keras.utils.PyDataset``, a Python generator or iterator, a torch ``DataLoader``),
    as opposed to arrays (anything with a ``shape`` or ``__array__``: NumPy, torch, TF,
    JAX) and lists, tuples and dicts of them. Strings, bytes and numbers are neither
    (refused as data).
    """
    return (x is not None and not hasattr(x, "shape") and not hasattr(x, "__array__")
            and not isinstance(x, (list, tuple, dict, str, bytes, numbers.Number)))

"""Python generators and ``keras.utils.PyDataset`` fed to MirroredStrategy per replica.

tf.distribute splits a ``tf.data`` batch over the replicas by rewriting the
pipeline's batch op; a generator's pipeline (``Dataset.from_generator``, Keras's
adapters) has none, so each replica receives *whole* batches of its own and the
model trains on N batches per step. Keras's symbolic build also pulls the first
batch from a generator's iterator and drops it. Both make a generator or PyDataset
train differently from one device.

Here the generator is read once, as whole global batches in order; each batch is
cut into N contiguous row blocks (sizes differ by at most one) and
``distribute_datasets_from_function`` hands block r of every batch to replica r.
So every replica gets its rows of each global batch, every sample is read exactly
once, and predict's outputs (replica blocks concatenated) stay in order.
"""

import inspect
import itertools

from kmgpu.engines import keras_fixes as common


def is_python_data(x):
    """True for a Python generator or a ``keras.utils.PyDataset``."""
    import keras

    return inspect.isgenerator(x) or isinstance(x, keras.utils.PyDataset)


def feed(strategy, kwargs, method, shuffle=False, guard=None):
    """``kwargs`` with a generator / PyDataset ``x`` (and fit's ``validation_data``)
    replaced by a per-replica distributed dataset; every global batch read passes
    ``guard`` (``batch_checks.Guard``; None: none) first.

    Returns:
        (kwargs, first) where ``first`` is the first global batch read (to build the
        model from without touching the feed), or None when nothing was replaced.
    """
    kw, first = dict(kwargs), None
    steps = "steps_per_epoch" if method == "fit" else "steps"
    if is_python_data(kw.get("x")):
        x = kw["x"]
        class_weight = kw.pop("class_weight", None) if method == "fit" else None
        kw["x"], first = _distributed(strategy, x, shuffle, class_weight, method == "fit",
                                      guard, "the training data" if method == "fit"
                                      else "the data")
        kw.update({key: None for key in ("y", "sample_weight") if key in kw})
        if kw.get(steps) is None:
            kw[steps] = _length(x)
    validation = kw.get("validation_data")
    if method == "fit" and is_python_data(validation):
        kw["validation_data"], _ = _distributed(strategy, validation, False, None, True,
                                                guard, "the validation data")
        if kw.get("validation_steps") is None:
            kw["validation_steps"] = _length(validation)
    return (kw, first) if first is not None or kw.get("validation_data") is not validation \
        else (kwargs, None)


def _length(source):
    """Batches in one pass of a PyDataset (None: a generator, or endless). Given as
    Keras's steps, so that fit keeps one iterator for all epochs (this feed repeats
    the passes) and evaluate/predict stop without an "ran out of data" warning."""
    return None if inspect.isgenerator(source) else source.num_batches


def _distributed(strategy, source, shuffle, class_weight, repeat, guard=None, what=""):
    import keras
    import numpy as np
    import tensorflow as tf

    if inspect.isgenerator(source):
        first = common.standardize_batch(next(source), class_weight)
        rest = (common.standardize_batch(b, class_weight) for b in source)
        stream = itertools.chain([first], rest)  # one stream: epochs continue it

        def passes():
            yield stream
    else:
        first = common.standardize_batch(source[0], class_weight)

        def passes():  # fit: pass after pass; evaluate / predict: one pass
            for _ in itertools.count() if repeat else range(1):
                yield common.py_dataset_pass(source, shuffle, class_weight)

    def batches():
        for number, one_pass in enumerate(passes()):
            for index, batch in enumerate(one_pass):
                if guard is not None:  # numbered as Keras's epochs count them
                    guard(batch, f"batch {index} of {what}" if not inspect.isgenerator(source)
                          else f"batch {index} read from the generator ({what})")
                yield batch

    first = keras.tree.map_structure(np.asarray, first)
    signature = keras.tree.map_structure(
        lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), first)
    replicas = strategy.num_replicas_in_sync

    def blocks(*batch):
        batch = batch if len(batch) > 1 else batch[0]
        rows = tf.shape(keras.tree.flatten(batch)[0])[0]
        sizes = rows // replicas + tf.cast(tf.range(replicas) < rows % replicas, tf.int32)
        starts = tf.cumsum(sizes, exclusive=True)

        def block(r):
            return keras.tree.map_structure(lambda t: t[starts[r]:starts[r] + sizes[r]],
                                            batch)

        return tf.data.Dataset.range(replicas).map(lambda r: block(tf.cast(r, tf.int32)))

    def dataset_fn(context):
        pipeline = tf.data.Dataset.from_generator(lambda: (tuple(b) for b in batches()),
                                                  output_signature=tuple(signature))
        return pipeline.flat_map(blocks).prefetch(replicas)

    return strategy.distribute_datasets_from_function(dataset_fn), first


def checked(kwargs, guard, method):
    """``kwargs`` with a ``tf.data`` dataset ``x`` (and fit's ``validation_data``) read
    through ``guard`` (``batch_checks.checked_dataset``), batch by batch."""
    import tensorflow as tf

    from kmgpu.engines import batch_checks

    kw = dict(kwargs)
    for key, what in (("x", "the training data" if method == "fit" else "the data"),
                      ("validation_data", "the validation data")):
        value = kw.get(key)
        if isinstance(value, tf.data.Dataset):
            kw[key] = batch_checks.checked_dataset(value, guard, what)
    return kw

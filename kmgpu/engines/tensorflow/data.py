"""Python generators, ``keras.utils.PyDataset`` and torch ``DataLoader`` fed per replica.

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
once, and predict's outputs (replica blocks concatenated) stay in order. Under several
workers (``kmgpu launch``) every worker reads the same stream and feeds its own replicas'
blocks: Keras's adapters there shard whole batches over the workers, so each trained
on batches of its own (measured, 2 workers, 1 epoch: 0.70-0.96 relative weight
difference from one device for a generator, a PyDataset and a DataLoader).
"""

import inspect
import itertools

from kmgpu.engines import data_fixes as common


def is_python_data(x):
    """True for a Python generator, a ``keras.utils.PyDataset`` or a torch ``DataLoader``."""
    import keras

    return inspect.isgenerator(x) or isinstance(x, keras.utils.PyDataset) or is_loader(x)


def is_loader(x):
    """True for a torch ``DataLoader`` (Keras's own test: a class of that name in
    ``torch.utils.data``)."""
    return any(c.__name__ == "DataLoader" and "torch.utils.data" in c.__module__
               for c in type(x).__mro__)


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
        # fit reads pass after pass; as many as the epochs when a pass is the epoch, so
        # that no pass is begun past the last (a shuffled one draws Python's or torch's
        # random state when it begins, which plain Keras does not draw)
        repeat = method == "fit"
        if repeat and kw.get(steps) is None and _length(x) is not None:
            repeat = max(int(kw.get("epochs", 1)) - int(kw.get("initial_epoch") or 0), 1)
        kw["x"], first = _distributed(strategy, x, shuffle, class_weight, repeat,
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
    """Batches in one pass of a PyDataset or a DataLoader (None: a generator, or
    endless). Given as Keras's steps, so that fit keeps one iterator for all epochs
    (this feed repeats the passes) and evaluate/predict stop without an "ran out of
    data" warning."""
    if inspect.isgenerator(source):
        return None
    if is_loader(source):
        try:
            return len(source) or None
        except TypeError:  # an iterable dataset without a length
            return None
    return source.num_batches


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
    elif is_loader(source):
        # as Keras's adapter reads it: a first iterator for the signature, then one per
        # pass (the loader reshuffles); the same draws of torch's random state, so a
        # shuffled training loader gives plain Keras's batches
        first = common.standardize_batch(_numpy(next(iter(source))), class_weight)

        def passes():
            for _ in _passes(repeat):
                yield (common.standardize_batch(_numpy(b), class_weight) for b in source)
    else:
        first = common.standardize_batch(source[0], class_weight)

        def passes():  # fit: pass after pass; evaluate / predict: one pass
            for _ in _passes(repeat):
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

    def blocks(low, local):
        """Blocks ``low`` .. ``low + local - 1`` of each global batch."""
        def cut(*batch):
            batch = batch if len(batch) > 1 else batch[0]
            rows = tf.shape(keras.tree.flatten(batch)[0])[0]
            sizes = rows // replicas + tf.cast(tf.range(replicas) < rows % replicas, tf.int32)
            starts = tf.cumsum(sizes, exclusive=True)

            def block(r):
                return keras.tree.map_structure(
                    lambda t: t[starts[r]:starts[r] + sizes[r]], batch)

            return tf.data.Dataset.range(low, low + local).map(
                lambda r: block(tf.cast(r, tf.int32)))

        return cut

    def dataset_fn(context):
        # several workers (kmgpu launch): every one reads the whole stream, and worker w's
        # pipeline gives its local replicas their blocks (replicas numbered worker by worker)
        local = replicas // context.num_input_pipelines
        pipeline = tf.data.Dataset.from_generator(lambda: (tuple(b) for b in batches()),
                                                  output_signature=tuple(signature))
        return pipeline.flat_map(blocks(context.input_pipeline_id * local, local)).prefetch(
            local)

    return strategy.distribute_datasets_from_function(dataset_fn), first


def _passes(repeat):
    """``repeat``: True (endless), False (one pass) or a number of passes."""
    if repeat is True:
        return itertools.count()
    return range(1 if repeat is False else repeat)


def _numpy(batch):
    """A DataLoader's batch (torch tensors) as NumPy arrays."""
    import keras
    import numpy as np

    return keras.tree.map_structure(
        lambda a: a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a),
        tuple(batch) if isinstance(batch, list) else batch)


def checked(kwargs, guard, method):
    """``kwargs`` with a ``tf.data`` dataset ``x`` (and fit's ``validation_data``) read
    through ``guard`` (a ``batch_checks.Guard``), batch by batch (``checked_dataset``)."""
    import tensorflow as tf

    kw = dict(kwargs)
    for key, what in (("x", "the training data" if method == "fit" else "the data"),
                      ("validation_data", "the validation data")):
        value = kw.get(key)
        if isinstance(value, tf.data.Dataset):
            kw[key] = checked_dataset(value, guard, what)
    return kw


def checked_dataset(dataset, guard, what):
    """``dataset`` (global batches) with every element checked by ``guard`` as it is read,
    numbered from 0 in each pass. In the pipeline a batch whose per-output sample weights
    are one set costs a few comparisons; only another one goes to ``guard`` on the host
    (a ``tf.py_function``), which refuses it."""
    import keras
    import numpy as np
    import tensorflow as tf

    spec = dataset.element_spec

    def run(index, *leaves):
        batch = keras.tree.pack_sequence_as(spec, [np.asarray(a) for a in leaves])
        guard(batch, f"batch {int(index)} of {what}")
        return np.int64(0)

    def unusual(element):
        _, _, sw = keras.utils.unpack_x_y_sample_weight(
            element if isinstance(element, tuple) else (element,))
        flag = tf.constant(False)
        if isinstance(sw, (tuple, list, dict)):
            leaves = tf.nest.flatten(sw)
            for w in leaves[1:]:
                flag = tf.logical_or(flag, tf.logical_not(tf.reduce_all(tf.equal(
                    tf.cast(leaves[0], tf.float32), tf.cast(w, tf.float32)))))
        return flag

    def each(index, element):
        done = tf.cond(unusual(element),
                       lambda: tf.py_function(run, [index] + tf.nest.flatten(element),
                                              Tout=tf.int64),
                       lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies([done]):
            return tf.nest.map_structure(tf.identity, element)

    # no autograph: ``each`` branches with tf.cond itself, and autograph's conversion of it
    # (and of what it calls) is slow, paid for every dataset mapped here
    return dataset.enumerate().map(tf.autograph.experimental.do_not_convert(each))

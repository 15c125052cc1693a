"""Data as Keras's TensorFlow trainer reads it under tf.distribute: fit's arrays fed as
one repeating ``tf.data`` pipeline (``repeating_datasets``; each epoch the rows of
Keras's own, ``first_pass_order``), evaluate's and predict's arrays likewise
(``one_pass_datasets``), and the lives of the distributed iterators Keras
makes during kmgpu's calls: kept until the next call and dropped on a thread of their own
(``park_iterators``), or handed over by the dataset's owner when fit's training arrays
are kept across calls (``own``, ``kept_input``), and made without tf.data's autotuning,
whose threads each destruction waited for (``untuned_iterators``). Rows of
``kmgpu/engines/tensorflow/keras_fixes.py``.
"""

import contextlib

from kmgpu.engines import keras_fixes


def first_pass_order(arrays, batch_size, shuffle):
    """Under a global seed, the rows of every epoch of Keras's own shuffled fit; else None.

    Keras 3.15.1 shuffles arrays inside its ``tf.data`` pipeline (``tf.random.shuffle``
    in a dataset function, or per batch for ``shuffle="batch"``) and reads a new
    iterator of that pipeline each epoch. A stateful random op in a dataset function
    starts again with each iterator, so under ``keras.utils.set_random_seed`` every epoch
    (and every ``fit`` call) reads the same permutation. The one repeating pipeline of
    ``repeating_datasets`` would go on drawing new ones: its first epoch only would be
    one device's. So the pass is read here from Keras's own pipeline over the row
    indices, and the arrays are fed in that order, unshuffled. Without a global seed
    each epoch draws anew on both sides, and nothing changes. NumPy arrays only (they
    are copied in that order); other array types keep Keras's pipeline.
    """
    import keras
    import numpy as np
    from keras.src.trainers.data_adapters import array_data_adapter
    from tensorflow.python.eager import context

    leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
    if (not shuffle or context.global_seed() is None or not leaves
            or not all(isinstance(a, np.ndarray) for a in leaves)):
        return None
    key = (context.global_seed(), len(leaves[0]), batch_size, shuffle)
    if key not in _ORDERS:  # a function of the key alone (the pipeline's op seeds are
        # fixed by its graph): read once, not at every call
        _ORDERS.clear()
        indices = array_data_adapter.ArrayDataAdapter(
            np.arange(len(leaves[0])), batch_size=batch_size, shuffle=shuffle)
        _ORDERS[key] = np.concatenate([np.asarray(b).reshape(-1)
                                       for b in indices.get_tf_dataset()])
    return _ORDERS[key]


_ORDERS = {}  # first_pass_order's last pass: (global seed, rows, batch size, shuffle) -> order


def repeating_datasets(kwargs, kept=None):
    """fit() on arrays, fed as repeating ``tf.data`` pipelines with known steps.

    For arrays Keras makes a new distributed iterator every epoch, which costs
    MirroredStrategy ~0.4 s per epoch on 4 devices, and one more at the end of the
    last epoch, never used (``EpochIterator._enumerate_iterator`` makes the next
    epoch's iterator when an epoch ends): fit(epochs=1) makes two. Given ``steps_per_epoch`` and
    a repeating dataset, Keras keeps one iterator for the whole fit. The dataset
    is Keras's own (``ArrayDataAdapter``): the same batches, the same per-epoch
    shuffling, class weights and partial last batch; each epoch reads exactly
    one pass. Validation arrays get the same treatment with ``validation_steps``.
    With ``kept`` (a ``kept_input.KeptInput``), the training pipeline, distributed, and
    its iterator are those of an earlier call where that changes no batch.
    """
    import keras
    from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
    from keras.src.trainers.data_adapters import data_adapter_utils

    def arrays(*data):
        return array_data_adapter.can_convert_arrays(data) and data[0] is not None

    kw = dict(kwargs)
    x, y, weights = kw.get("x"), kw.get("y"), kw.get("sample_weight")
    if kw.get("steps_per_epoch") is not None or not arrays(x, y, weights):
        return kwargs
    if kw.get("validation_split") and kw.get("validation_data") is None:
        (x, y, weights), kw["validation_data"] = array_slicing.train_validation_split(
            (x, y, weights), validation_split=kw["validation_split"])
    kw["validation_split"] = 0.0
    batch_size, shuffle, class_weight = (kw.get("batch_size") or 32, kw.get("shuffle", True),
                                         kw.get("class_weight"))
    order = first_pass_order((x, y, weights), batch_size, shuffle)
    if order is not None:  # every epoch reads that pass, as on one device
        x, y, weights = keras.tree.map_structure(
            lambda a: None if a is None else a[order], (x, y, weights), none_is_leaf=True)
        shuffle = False

    def build(x, y, weights):
        return _repeating(x, y, weights, batch_size, shuffle=shuffle,
                          class_weight=class_weight)

    made = None if kept is None else kept.dataset(
        (x, y, weights), shuffle,
        (batch_size, shuffle, None if class_weight is None else dict(class_weight)), build)
    dataset, steps = made or build(x, y, weights)
    kw.update(x=dataset, y=None, sample_weight=None, shuffle=False, class_weight=None,
              batch_size=None, steps_per_epoch=steps)
    validation = kw.get("validation_data")
    if validation is not None and kw.get("validation_steps") is None:
        vx, vy, vw = data_adapter_utils.unpack_x_y_sample_weight(validation)
        if arrays(vx, vy, vw):
            repeated, steps = _repeating(vx, vy, vw,
                                         kw.get("validation_batch_size") or batch_size)
            kw.update(validation_data=repeated, validation_steps=steps,
                      validation_batch_size=None)
    return kw


def one_pass_datasets(kwargs, method, kept):
    """evaluate() or predict() on arrays, fed as a kept repeating ``tf.data`` pipeline
    with known steps, so that a loop of calls on the same arrays reads one distributed
    iterator.

    Keras makes a new distributed iterator for every evaluate and predict on arrays, and
    one more at the end of the pass, never used: under MirroredStrategy each traces its
    per-device functions, ~0.4 s on 2 CPU devices, most of a small evaluate. The batches
    are Keras's own (``ArrayDataAdapter``, unshuffled: the same rows in the same order, the
    same partial last batch); ``kept`` (a ``kept_input.KeptInput`` of this method) holds
    the pipeline, distributed, and its iterator to the next call on arrays of the same bits
    and batch size, and each call reads exactly one pass (``steps``).

    Returns:
        ``kwargs`` with ``x`` the distributed dataset and ``steps`` set, or ``kwargs``
        unchanged (not arrays, ``steps`` given, or arrays ``kept`` does not keep).
    """
    from keras.src.trainers.data_adapters import array_data_adapter

    x, y, weights = kwargs.get("x"), kwargs.get("y"), kwargs.get("sample_weight")
    if kwargs.get("steps") is not None or x is None or \
            not array_data_adapter.can_convert_arrays((x, y, weights)):
        return kwargs
    batch_size = kwargs.get("batch_size") or 32

    def build(x, y, weights):
        return _repeating(x, y, weights, batch_size, shuffle=False)

    made = kept.dataset((x, y, weights), False, (method, batch_size), build)
    if made is None:
        return kwargs
    kw = dict(kwargs, x=made[0], batch_size=None, steps=made[1])
    kw.update({key: None for key in ("y", "sample_weight") if key in kw})
    return kw


def _repeating(x, y, weights, batch_size, **options):
    """Keras's own pipeline of these arrays (``ArrayDataAdapter``: its batches, its
    shuffling and class weights as ``options`` say), repeated, and its batches per pass."""
    from keras.src.trainers.data_adapters import array_data_adapter

    adapter = array_data_adapter.ArrayDataAdapter(x, y, sample_weight=weights,
                                                  batch_size=batch_size, **options)
    return adapter.get_tf_dataset().repeat(), adapter.num_batches


def untuned_iterators():
    """Within the block, the pipelines behind each ``MultiDeviceIterator`` that
    tf.distribute makes run without tf.data's autotuning: the host pipeline (the data,
    unless its options turn autotuning on themselves) and each replica's per-device
    pipeline (a generator reading the replica's shard, then ``prefetch(1)``: nothing to
    tune). Each autotuned pipeline has a thread that sleeps between rounds (10 ms, 20 ms,
    ... doubling up to 60 s), and destroying a multi-device iterator waits out those
    sleeps (TensorFlow 2.21; a plain ``iter(dataset)`` does not): a drop waited 0.2-20
    s, and a process hung 5-90 s at exit for one fit's iterators (test processes 40-360
    s). Untuned, an ``AUTOTUNE`` map runs min(16, cores) calls at once, and an
    ``AUTOTUNE`` prefetch still grows its buffer (its own tuner).
    """
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    options = tf.data.Options()
    options.autotune.enabled = False

    def untuned_device(create):
        def create_device_dataset(*args, **kwargs):
            return create(*args, **kwargs).with_options(options)
        return create_device_dataset

    def untuned_host(init):
        def untuned_init(self, dataset=None, *args, **kwargs):
            if dataset is not None and dataset.options().autotune.enabled is None:
                dataset = dataset.with_options(options)
            init(self, dataset, *args, **kwargs)
        return untuned_init

    return keras_fixes.swapped((ops, "_create_device_dataset", untuned_device),
                               (ops.OwnedMultiDeviceIterator, "__init__", untuned_host))


_PARKED = {"depth": 0, "kept": [], "dropping": []}
_OWNED = {}  # id(distributed dataset) -> weak reference to its kept_input.KeptInput
RELEASE_AT_EXIT_S = 60.0  # at exit, the longest wait for drops still under way
RELEASE_THREAD = "kmgpu-iterator-release"  # each drop's thread, by name


def _drop(kept):
    """Drop the iterators of one call (on a thread of its own). TensorFlow's teardown of
    a MultiDeviceIterator waited 0.2-20 s now and then, idle (no CPU, the GIL released),
    before ``untuned_iterators``: the thread keeps any such wait off the user's next
    call."""
    kept.clear()


def _release(kept):
    """Drop one call's parked iterators on a daemon thread of its own. One thread per
    drop, not one queue: the waits are idle, and a queue made each drop wait for the
    ones before it (17 of 60 done at the end of a stress loop, the rest still alive)."""
    import threading

    if not kept:
        return
    thread = threading.Thread(target=_drop, args=(kept,), name=RELEASE_THREAD, daemon=True)
    thread.start()
    _PARKED["dropping"] = [t for t in _PARKED["dropping"] if t.is_alive()] + [thread]


def _release_parked():
    """At exit, while TensorFlow is still whole (atexit runs before module teardown):
    the last call's iterators, and the drops still under way."""
    import gc
    import time

    for ref in list(_OWNED.values()):  # the training inputs kept across calls
        owner = ref()
        if owner is not None:
            owner.drop()
    gc.collect()  # iterators in reference cycles (a fault's traceback and its frames)
    _PARKED["kept"].clear()
    end = time.monotonic() + RELEASE_AT_EXIT_S
    for thread in _PARKED["dropping"]:
        thread.join(max(0.0, end - time.monotonic()))


@contextlib.contextmanager
def park_iterators():
    """Within the block, every distributed iterator Keras makes from a
    ``TFEpochIterator`` is kept alive past the call that made it, and released at the
    start of the user's next kmgpu call (on a thread of its own, see ``_drop``), when
    its prefetch has long finished. Keras drops them at once (at the end of ``fit``,
    at each ``reset``), often while the per-device prefetch is still fetching the next
    batch, and destroying a
    ``MultiDeviceIterator`` then sometimes segfaults (TensorFlow 2.21). Kept one call
    only: live iterators' prefetch threads slow the next call down, measurably with two
    calls' iterators alive, not with one.
    """
    import atexit

    from keras.src.backend.tensorflow import trainer

    parked = _PARKED
    if not parked.get("atexit"):
        parked["atexit"] = atexit.register(_release_parked)
    if parked["depth"] == 0:  # a call of the user's (fit's validation is inside one)
        kept, parked["kept"] = parked["kept"], []
        _release(kept)  # on a thread of its own: its teardown may wait (see _drop)
        del kept
    parked["depth"] += 1

    def parking(original):
        def parked_iterator(self):
            return _Parked(original(self), parked["kept"])
        return parked_iterator

    try:
        with keras_fixes.swapped((trainer.TFEpochIterator, "_get_iterator", parking)):
            yield
    finally:
        parked["depth"] -= 1


def park(iterators):
    """Hand ``iterators`` (a list, emptied) to the drop at the start of the next call, as
    the iterators Keras reads are (``park_iterators``)."""
    _PARKED["kept"].extend(iterators)
    iterators.clear()


def own(dataset, owner):
    """``dataset``'s iterators come from ``owner.iterator()`` (a ``kept_input.KeptInput``,
    which keeps one across calls) instead of a new one per call."""
    import weakref

    _OWNED[id(dataset)] = weakref.ref(owner)


def disown(dataset):
    _OWNED.pop(id(dataset), None)


def _owner(dataset):
    ref = _OWNED.get(id(dataset))
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner.holds(dataset) else None


class _Parked:
    """A distributed dataset whose iterators are kept in ``keep`` (or by its owner)."""

    def __init__(self, dataset, keep):
        self.dataset, self.keep = dataset, keep

    def __iter__(self):
        owner = _owner(self.dataset)
        if owner is not None:  # kept across calls: not parked
            return owner.iterator()
        iterator = iter(self.dataset)
        self.keep.append(iterator)
        return iterator

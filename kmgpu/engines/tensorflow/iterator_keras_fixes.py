"""Keras and TensorFlow internals that govern the lives of the distributed iterators
Keras makes during kmgpu's calls: kept until the next call and dropped on a thread of
their own (``park_iterators``), or handed over by the dataset's owner when fit's training
arrays are kept across calls (``own``, ``kept_input``), and made without tf.data's
autotuning, whose threads each destruction waited for (``untuned_iterators``). Part of the TensorFlow engine's
``keras_fixes`` (its ``PATCHES`` table includes this module's).
"""

import contextlib

PATCHES = [
    ("keras.src.backend.tensorflow.trainer", "TFEpochIterator._get_iterator",
     "wrapped during kmgpu's calls (park_iterators): Keras drops a distributed iterator "
     "while its per-device prefetch may still be fetching (a repeating dataset at the end "
     "of fit, a validation iterator at each reset); tf.data's MultiDeviceIterator then "
     "crashes the process now and then (SIGSEGV, 1 in ~150 one-epoch fits on 4 CPU "
     "devices under load); kmgpu keeps each one until the next call, when it is idle, "
     "and drops it then on a thread of its own: the drop waited, idle, 0.2-20 s now and "
     "then (TensorFlow's teardown of the MultiDeviceIterator; 51 of 150 drops over "
     "0.2 s on a loaded 2-core machine; see untuned_iterators), which the user's next "
     "call does not wait for"),
    ("tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset",
     "wrapped during calls (untuned_iterators): destroying a MultiDeviceIterator waits "
     "out the sleep (up to 60 s) of each autotuned pipeline's tuning thread: drops of "
     "a distributed iterator waited 0.2-20 s, processes hung 5-360 s at exit; this "
     "makes each replica's per-device pipeline (nothing to tune) untuned"),
    ("tensorflow.python.data.ops.multi_device_iterator_ops",
     "OwnedMultiDeviceIterator.__init__", "same, for the host pipeline it reads"),
]


@contextlib.contextmanager
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

    create, init = ops._create_device_dataset, ops.OwnedMultiDeviceIterator.__init__
    options = tf.data.Options()
    options.autotune.enabled = False

    def create_device_dataset(*args, **kwargs):
        return create(*args, **kwargs).with_options(options)

    def untuned_init(self, dataset=None, *args, **kwargs):
        if dataset is not None and dataset.options().autotune.enabled is None:
            dataset = dataset.with_options(options)
        init(self, dataset, *args, **kwargs)

    ops._create_device_dataset, ops.OwnedMultiDeviceIterator.__init__ = \
        create_device_dataset, untuned_init
    try:
        yield
    finally:
        ops._create_device_dataset, ops.OwnedMultiDeviceIterator.__init__ = create, init


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
    original = trainer.TFEpochIterator._get_iterator

    def _get_iterator(self):
        return _Parked(original(self), parked["kept"])

    trainer.TFEpochIterator._get_iterator = _get_iterator
    try:
        yield
    finally:
        trainer.TFEpochIterator._get_iterator = original
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

"""fit's training arrays (and evaluate's, and predict's) kept across calls: one
distributed dataset and its live iterator per method.

Building a ``fit``'s ``tf.data`` pipeline for arrays, distributing it, and having
tf.distribute make a ``MultiDeviceIterator`` for it traces that iterator's per-device
functions: a large share of a short ``fit`` (plain Keras on one device makes a plain
iterator), paid by a loop of ``fit(epochs=1)`` calls at every call and by one
``fit(epochs=10)`` once; evaluate and predict make one at every call. Here the pipeline
and its iterator live on to the next call of the same method when that call's batches
are provably those a fresh pipeline would give:

- the arrays hold the same bits, shapes and dtypes as the tensors the pipeline was built
  from (compared at every call, on the host: an array changed in place, or another one,
  builds a new pipeline);
- the same batch size, class weights and shuffling. Under a global seed a shuffled fit
  comes here unshuffled, its arrays in the order of Keras's first pass (the same at every
  call: ``data_fixes.first_pass_order``); a pipeline that shuffles is kept only without a
  global seed, where its next pass draws a new permutation as a fresh pipeline would (with
  one, a continued iterator would draw the next permutation where plain Keras draws the
  first one again);
- every earlier call read whole passes from the iterator (returned normally, no
  ``stop_training`` / ``stop_evaluating`` / ``stop_predicting``, no
  ``keras.config.max_steps_per_epoch``), so its next element is
  the first batch of a pass. A call that raised or stopped early drops the iterator; the
  next call starts a new one from the kept dataset, at the start of a pass.

Each method's pipeline holds one copy of its arrays (as plain Keras's does during a call)
until another call of that method brings other data, the engine closes, or the process exits; dropped
iterators go through ``data_fixes.park`` (destroyed at the next call, idle).
"""

import weakref

from kmgpu.engines.tensorflow import data_fixes

#: bytes compared at a time (bounds the temporary memory of the comparison)
CHUNK_BYTES = 1 << 24


class KeptInput:
    """The input of one engine's fits (or evaluates, or predicts: one ``KeptInput``
    each; single worker, arrays, one step per execution), kept across calls where that
    changes no batch."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._slot = []  # the live iterator, if any (parked when this object goes)
        weakref.finalize(self, data_fixes.park, self._slot)
        self._clear()
        self.builds = 0  # distributed datasets made, for tests

    def _clear(self):
        self._dataset = self._signature = self._tensors = self._settings = None
        self.first = None  # the first global batch, for the replica's symbolic build
        self._used = False

    def holds(self, dataset):
        """Whether ``dataset`` is the distributed dataset kept here."""
        return dataset is not None and dataset is self._dataset

    def dataset(self, arrays, shuffle, settings, build):
        """The distributed dataset of these training arrays: the kept one when they hold
        its bits under the same settings, else a new one (the old one dropped).

        Args:
            arrays: (x, y, sample_weight), each a structure of arrays or None.
            shuffle: how the pipeline shuffles (fit's ``shuffle``); anything but False is
                kept only without a global seed.
            settings: what else decides the batches (batch size, class weights),
                compared with ``==``.
            build: (x, y, sample_weight) as TensorFlow tensors -> (a repeating
                ``tf.data`` dataset of global batches, batches per pass).

        Returns:
            (distributed dataset, batches per pass), or None when these arrays are not
            kept (shuffled under a global seed, or not all NumPy arrays of numbers):
            build as before.
        """
        import keras
        import numpy as np
        import tensorflow as tf
        from tensorflow.python.eager import context

        leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
        seeded = shuffle is not False and context.global_seed() is not None
        if seeded or not leaves or not all(
                isinstance(a, np.ndarray) and a.dtype.kind in "biufc" and a.ndim
                for a in leaves):
            self.drop()
            return None
        signature = keras.tree.map_structure(
            lambda a: None if a is None else (a.shape, a.dtype.str), arrays)
        if self._dataset is not None and self._settings == settings \
                and self._signature == signature \
                and all(_same_bits(a, np.asarray(t)) for a, t in zip(leaves, self._tensors)):
            return self._dataset, self._steps
        self.drop()
        tensors = keras.tree.map_structure(
            lambda a: None if a is None else tf.convert_to_tensor(a), arrays)
        repeated, steps = build(*tensors)
        self.builds += 1
        self.first = next(iter(repeated.take(1)))
        self._dataset = self.strategy.experimental_distribute_dataset(repeated)
        self._tensors = [t for t in keras.tree.flatten(tensors) if t is not None]
        self._signature, self._settings, self._steps = signature, settings, steps
        data_fixes.own(self._dataset, self)
        return self._dataset, self._steps

    def iterator(self):
        """The kept iterator, or a new one (at the start of a pass) when none is kept:
        what Keras's fit reads this call (``data_fixes`` hands it over)."""
        if not self._slot:
            self._slot.append(iter(self._dataset))
        self._used = True
        return self._slot[0]

    def finished(self, whole_passes):
        """After each call: the iterator this call read stays only if the call read
        whole passes (else it is parked and dropped at the next call)."""
        if self._used and not whole_passes:
            data_fixes.park(self._slot)
        self._used = False

    def drop(self):
        """Forget the kept input (its iterator parked, dropped at the next call)."""
        data_fixes.park(self._slot)
        if self._dataset is not None:
            data_fixes.disown(self._dataset)
        self._clear()


def _same_bits(array, kept):
    """Whether ``array`` holds exactly the bits of ``kept`` (same shape and dtype), read
    in blocks of rows."""
    import numpy as np

    if array.shape != kept.shape or array.dtype != kept.dtype:
        return False
    rows = max(1, CHUNK_BYTES // max(1, array[:1].nbytes))
    for start in range(0, len(array), rows):
        a = np.ascontiguousarray(array[start:start + rows]).view(np.uint8)
        b = np.ascontiguousarray(kept[start:start + rows]).view(np.uint8)
        if not np.array_equal(a, b):
            return False
    return True

"""Datasets the torch ranks cannot index, read for them: ``tf.data``, generators, DataLoaders.

A ``keras.utils.PyDataset`` is indexed batch by batch on every rank (``data``).
Anything else that brings its own batches (``checks.is_dataset``) is read here with
Keras's own ``EpochIterator``, so every epoch holds exactly the batches Keras's fit
on one device would take (a ``tf.data`` shuffle reshuffled each pass, a generator
continued from epoch to epoch with ``steps_per_epoch``). The batches become a
PyDataset the ranks cut as usual (``data.RankSlices``):

- evaluate, predict and fit's validation data: one pass, read before the call
  (``one_pass``): arrays in the call's files (``StoredBatches``) for a pool, in
  memory (``Batches``) in-process;
- fit's training data, one pass per epoch: a pool's driver reads pass 0 before the
  call and each next one in a thread (``Feed``) once rank 0 has begun the one
  before, into files the ranks wait for (``StreamedBatches``); in-process, each
  rank reads its own pass at every epoch start (``LocalStream``).
"""

import json
import os
import threading
import time

import keras
import numpy as np

from kmgpu.engines.torch import keras_fixes, transport


def reads_itself(x):
    """True for a dataset kmgpu reads for the ranks (a dataset, not a PyDataset)."""
    from kmgpu.checks import is_dataset

    return is_dataset(x) and not isinstance(x, keras.utils.PyDataset)


def _as_tuple(batch):
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def read_pass(iterator):
    """One epoch of a Keras ``EpochIterator``: its batches, each an (x, y, sw) tuple."""
    return [_as_tuple(buffer[0]) for _, _, buffer in iterator]


def one_pass(x, steps=None, build=None):
    """The batches of one epoch of ``x``, as Keras's evaluate (``build``: the user's
    model) or predict (None) takes them."""
    iterator = keras_fixes.epoch_iterator(x, steps, build)
    return read_pass(iterator)


def _ran_out(got, steps, what):
    return ValueError(
        f"kmgpu (torch): the training data ran out after {got} batch(es) of {what}, "
        f"where every epoch takes {steps}. Keras's fit takes steps_per_epoch batches per "
        "epoch from one generator or iterator (epochs x steps_per_epoch in all): make it "
        "loop (while True: ...), repeat the dataset (dataset.repeat()), or pass fewer "
        "epochs or steps_per_epoch.")


class Batches(keras.utils.PyDataset):
    """Batches held in memory (in-process)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = list(batches)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


class StoredBatches(keras.utils.PyDataset):
    """Batches the driver read and stored as arrays and batch bounds (pool workers
    map them from the call's files)."""

    def __init__(self, parts, bounds):
        super().__init__()
        self.parts, self.bounds = parts, list(bounds)
        self._loaded = False

    def __len__(self):
        return len(self.bounds) - 1

    def __getitem__(self, i):
        if not self._loaded:
            self.parts, self._loaded = transport.resolve(self.parts), True
        lo, hi = self.bounds[i], self.bounds[i + 1]
        return keras.tree.map_structure(lambda a: None if a is None else a[lo:hi], self.parts)


def store(batches, files):
    """``batches`` (a list of tuples) as a StoredBatches in ``files`` (a CallFiles)."""
    bounds = [0]
    for batch in batches:
        leaves = [a for a in keras.tree.flatten(batch[0]) if a is not None]
        bounds.append(bounds[-1] + int(np.shape(leaves[0])[0]))
    if not batches:
        return StoredBatches((), bounds)
    parts = keras.tree.map_structure(
        lambda *leaves: None if leaves[0] is None else np.concatenate(
            [transport.as_array(leaf) for leaf in leaves]), *batches)
    return StoredBatches(files.put(parts), bounds)


class _Passes(keras.utils.PyDataset):
    """fit's training data, one pass per epoch: ``steps`` batches each.

    ``NextPass`` moves it on at every epoch start of the fit (a PyDataset's own
    ``on_epoch_begin`` is no count of epochs: Keras's first fit of a model also
    calls it to build the model from one batch).
    """

    def __init__(self, steps):
        super().__init__()
        self.steps, self.index, self.current = steps, 0, None
        self._started = False

    def __len__(self):
        return self.steps

    def next_pass(self):
        if self._started:
            self.index, self.current = self.index + 1, None
        self._started = True
        self._ensure()

    def _ensure(self):
        if self.current is None:
            self.current = self._load(self.index)
            if len(self.current) < self.steps:
                raise _ran_out(len(self.current), self.steps, f"epoch {self.index + 1}")

    def __getitem__(self, i):
        self._ensure()
        return self.current[i]

    def _load(self, index):
        raise NotImplementedError


class NextPass(keras.callbacks.Callback):
    """The rank's callback that moves fit's streamed training data (if any) to the next
    pass at every epoch start.

    Args:
        x: fit's training data as the rank got it.
    """

    def __init__(self, x):
        super().__init__()
        self.x = x

    def on_epoch_begin(self, epoch, logs=None):
        if isinstance(self.x, _Passes):
            self.x.next_pass()


class LocalStream(_Passes):
    """In-process: this rank reads every pass itself (every process has the same data).

    Args:
        x: the dataset or generator.
        steps_per_epoch: fit's argument (None: a whole pass).
        build: the user's model (Keras's fit builds it from the iterator first).
    """

    def __init__(self, x, steps_per_epoch=None, build=None):
        self._iterator = keras_fixes.epoch_iterator(x, steps_per_epoch, build)
        self._first = read_pass(self._iterator)
        if not self._first:
            raise ValueError("kmgpu (torch): the training data yielded no batch.")
        super().__init__(len(self._first))

    def _load(self, index):
        if index == 0:
            first, self._first = self._first, None
            return first
        return read_pass(self._iterator)


class StreamedBatches(_Passes):
    """In a pool worker: pass ``i`` is the arrays the driver's ``Feed`` named in
    ``<path>/pass<i>.json`` (raw ``.npy`` files and batch bounds, or an error; files
    are never unpickled), in the structure of pass 0's batches; rank 0 marks
    ``begun<i>`` when it starts one."""

    def __init__(self, path, steps, structure):
        super().__init__(steps)
        self.path, self.structure = path, structure

    def _load(self, index):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 0:
            transport.private_file(os.path.join(self.path, f"begun{index}"))
        name = os.path.join(self.path, f"pass{index}.json")
        while not os.path.exists(name):
            time.sleep(0.01)
        with open(name) as f:
            manifest = json.load(f)
        if "error" in manifest:  # the driver could not read this pass
            raise RuntimeError(manifest["error"])
        if len(manifest["bounds"]) == 1:
            return []
        leaves = [None if p is None else transport.Leaf(p) for p in manifest["leaves"]]
        return StoredBatches(keras.tree.pack_sequence_as(self.structure, leaves),
                             manifest["bounds"])


class Feed:
    """On a pool's driver: fit's training data for the workers, one pass per epoch.

    Pass 0 is read now (it fixes the steps per epoch); a thread reads pass ``i``
    once rank 0 has begun pass ``i - 1`` (so at most two passes exist at a time) and
    removes pass ``i - 2``.

    Args:
        x: the dataset or generator.
        steps_per_epoch: fit's argument (None: a whole pass).
        passes: how many epochs the fit runs.
        files: the call's ``transport.CallFiles`` (this feed's folder lives there).
        build: the user's model (Keras's fit builds it from the iterator first).
    """

    def __init__(self, x, steps_per_epoch, passes, files, build=None):
        self.path = os.path.join(files.path, "feed")
        os.mkdir(self.path, 0o700)
        self._iterator = keras_fixes.epoch_iterator(x, steps_per_epoch, build)
        first = read_pass(self._iterator)
        if not first:
            raise ValueError("kmgpu (torch): the training data yielded no batch.")
        self.steps, self.passes, self.structure = len(first), passes, None
        self._files, self._stop = [], threading.Event()
        self._write(0, first)
        self._thread = None
        if passes > 1:
            self._thread = threading.Thread(target=self._produce, daemon=True,
                                            name="kmgpu-feed")
            self._thread.start()

    def remote(self):
        """What the workers get: a StreamedBatches over this feed's folder."""
        return StreamedBatches(self.path, self.steps, self.structure)

    def _write(self, index, batches_or_error):
        if isinstance(batches_or_error, str):
            manifest = {"error": batches_or_error}
        else:
            files = transport.CallFiles(0)
            self._files.append(files)
            stored = store(batches_or_error, files)
            if self.structure is None:
                self.structure = stored.parts
            manifest = {"bounds": stored.bounds, "leaves": [
                leaf.path if isinstance(leaf, transport.Leaf) else None
                for leaf in keras.tree.flatten(stored.parts)]}
        tmp = transport.private_file(os.path.join(self.path, f".pass{index}"))
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, os.path.join(self.path, f"pass{index}.json"))

    def _produce(self):
        index = 1
        try:
            for index in range(1, self.passes):
                begun = os.path.join(self.path, f"begun{index - 1}")
                while not os.path.exists(begun):
                    if self._stop.wait(0.01):
                        return
                batches = read_pass(self._iterator)
                if len(self._files) >= 2:
                    self._files.pop(0).close()  # pass index - 2: every rank is past it
                self._write(index, batches)
        except BaseException as e:  # the ranks raise it when they reach this pass
            if not self._stop.is_set():
                try:
                    self._write(index, f"kmgpu (torch): reading the training data for "
                                       f"epoch {index + 1} failed: {type(e).__name__}: {e}")
                except OSError:
                    pass

    def close(self):
        """Stop reading; remove every pass's files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for files in self._files:
            files.close()
        self._files = []

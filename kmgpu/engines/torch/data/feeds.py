"""Datasets the torch ranks cannot index, read for them: ``tf.data``, generators, DataLoaders.

A ``keras.utils.PyDataset`` is indexed batch by batch on every rank (``inputs``).
Anything else that brings its own batches (``datasets.is_dataset``) is read here with
Keras's own ``TorchEpochIterator``, so every pass holds exactly the batches Keras's
fit on one device would take (a ``tf.data`` shuffle reshuffled each pass, a
DataLoader's generator advanced as Keras advances it, a generator continued from
epoch to epoch with ``steps_per_epoch``, a validation generator's peeked batches
replayed before it continues). The batches become a PyDataset the ranks cut as usual
(``inputs.RankSlices``):

- evaluate and predict: one pass, read before the call (``one_pass``): arrays in the
  call's files (``StoredBatches``) for a pool, in memory (``Batches``) in-process;
- fit's training data, one pass per epoch, and its validation data, one pass per
  validation: a pool's driver reads pass 0 of each before the call and the next
  epoch's in a thread (``Feed``) once rank 0 has begun the epoch before, into files
  the ranks wait for (``StreamedBatches``); in-process, each rank reads its own
  passes when it needs them (``LocalStream``).
"""

import contextlib
import json
import os
import threading
import time

import keras
import numpy as np
import torch

from kmgpu.engines.torch import data_fixes, transport


def reads_itself(x):
    """True for a dataset kmgpu reads for the ranks (a dataset, not a PyDataset)."""
    from kmgpu.engines.datasets import is_dataset

    return is_dataset(x) and not isinstance(x, keras.utils.PyDataset)


def _as_tuple(batch):
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def read_pass(iterator, fresh=False):
    """One epoch of a Keras ``TorchEpochIterator``: its batches, each an (x, y, sw) tuple
    of NumPy arrays. ``fresh``: reset it first, as Keras's evaluate resets the
    validation iterator fit keeps (a generator replays the batches Keras peeked at,
    then continues)."""
    with keras.device("cpu"):  # Keras converts a generator's batches on its device
        if fresh:
            iterator.reset()
        return [keras.tree.map_structure(transport.as_array, _as_tuple(buffer[0]))
                for _, _, buffer in iterator]


def one_pass(x, steps=None, build=None):
    """The batches of one epoch of ``x``, as Keras's evaluate (``build``: the user's
    model) or predict (None) takes them."""
    iterator = data_fixes.epoch_iterator(x, steps, build)
    return read_pass(iterator)


def validates(epoch, validation_freq):
    """Whether Keras's fit validates after ``epoch`` (``Trainer._should_eval``)."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


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
    """Data read for the ranks, one pass at a time: fit's training data (``steps``
    batches each epoch) or its validation data (``steps`` None: as many batches as
    the pass holds).

    ``next_pass`` moves it on: ``NextPass`` at every epoch start of the fit for the
    training data (a PyDataset's own ``on_epoch_begin`` is no count of epochs: Keras's
    first fit of a model also calls it to build the model from one batch), the rank's
    evaluate before each of fit's validations (``RankSlices.next_pass``).
    """

    def __init__(self, steps=None):
        super().__init__()
        self.steps, self.index, self.current = steps, 0, None
        self._started = False

    def __len__(self):
        if self.steps is None:
            self._ensure()
            return len(self.current)
        return self.steps

    def next_pass(self):
        if self._started:
            self.index, self.current = self.index + 1, None
        self._started = True
        self._ensure()

    def _ensure(self):
        if self.current is None:
            self.current = self._load(self.index)
            if self.steps is not None and len(self.current) < self.steps:
                raise _ran_out(len(self.current), self.steps, f"epoch {self.index + 1}")

    def __getitem__(self, i):
        self._ensure()
        return self.current[i]

    def _load(self, index):
        raise NotImplementedError


class NextPass(keras.callbacks.Callback):
    """The rank's callback that moves fit's training data read for the ranks (if any)
    to the next pass at every epoch start; on rank 0 it also marks each epoch begun
    in the driver's ``Feed`` folder (the feed then reads the next epoch's passes).

    Args:
        x: fit's training data as the rank got it.
        validation_data: fit's validation data as the rank got it.
    """

    def __init__(self, x, validation_data=None):
        super().__init__()
        self.x, self.begun = x, 0
        self.path = next((d.path for d in (x, validation_data)
                          if isinstance(d, StreamedBatches)), None)

    def on_epoch_begin(self, epoch, logs=None):
        if self.path is not None:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() == 0:
                transport.private_file(os.path.join(self.path, f"begun{self.begun}"))
            self.begun += 1
        if isinstance(self.x, _Passes):
            self.x.next_pass()


class KerasDraws:
    """In-process: torch's global random state as plain Keras's reads leave it.

    What a rank reads itself (and the draws of fit's validations over arrays beside
    them) draws on this state, in Keras's order; the rank's own Keras iterating over
    what was read (a PyDataset's DataLoader, whose seeds Keras's fit on the data
    itself would not draw) draws on the process's. ``leave_as_keras`` then leaves the process
    where plain Keras leaves it, as a pool's driver, which reads for its workers.
    """

    def __init__(self):
        self.state, self.used, self._active = torch.get_rng_state(), False, False

    @contextlib.contextmanager
    def active(self, use=True):
        """Draw on this state within the block (nested blocks: the outer one's)."""
        if not use or self._active:
            yield
            return
        self.used, self._active = True, True
        own = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(own)
            self._active = False

    def leave_as_keras(self):
        """After the call: the process's state is Keras's (if anything was read)."""
        if self.used:
            torch.set_rng_state(self.state)


class LocalStream(_Passes):
    """In-process: this rank reads every pass itself (every process has the same data).

    Args:
        x: the dataset or generator.
        host: the rank's ``KerasDraws`` (every read draws on it).
        steps: fit's steps_per_epoch or validation_steps (None: a whole pass).
        build: the user's model (Keras's fit builds it from the iterator first).
        validation: fit's validation data: passes of any length, each read from the
            iterator reset (Keras's evaluate).
        draws: (a function, the epochs that validate) for arrays validating this
            training data: it draws what such a validation draws, after its epoch's
            pass, as Keras's fit does.
    """

    def __init__(self, x, host, steps=None, build=None, validation=False, draws=None):
        self._host, self._draws = host, draws
        with host.active():
            self._iterator = data_fixes.epoch_iterator(x, steps, build)
            self._first, self._fresh = read_pass(self._iterator), validation
            self._validation_draws(0)
        if not self._first and not validation:
            raise ValueError("kmgpu (torch): the training data yielded no batch.")
        super().__init__(None if validation else len(self._first))

    def _validation_draws(self, epoch):
        if self._draws is not None and epoch in self._draws[1]:
            self._draws[0]()

    def _load(self, index):
        if index == 0:
            first, self._first = self._first, None
            return first
        with self._host.active():
            batches = read_pass(self._iterator, self._fresh)
            self._validation_draws(index)
        return batches


class StreamedBatches(_Passes):
    """In a pool worker: pass ``i`` is the arrays the driver's ``Feed`` named in
    ``<path>/<prefix><i>.json`` (raw ``.npy`` files and batch bounds, or an error;
    files are never unpickled), in the structure of pass 0's batches."""

    def __init__(self, path, steps, structure, prefix="pass"):
        super().__init__(steps)
        self.path, self.structure, self.prefix = path, structure, prefix

    def _load(self, index):
        name = os.path.join(self.path, f"{self.prefix}{index}.json")
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


class _Stream:
    """One dataset a ``Feed`` reads: Keras's iterator over it and its passes' files.

    Args:
        path: the feed's folder.
        prefix: the passes' file names (``<prefix><i>.json``).
        iterator: ``data_fixes.epoch_iterator`` over the data.
        what: the data, for errors.
        fresh: reset the iterator before each pass (validation data).
    """

    def __init__(self, path, prefix, iterator, what, fresh):
        self.path, self.prefix, self.iterator = path, prefix, iterator
        self.what, self.fresh = what, fresh
        self.files, self.structure, self.count = [], None, 0

    def read(self):
        """Read the next pass into files (the one two passes back is removed: every
        rank is past it); returns its batches."""
        batches = read_pass(self.iterator, self.fresh)
        if len(self.files) >= 2:
            self.files.pop(0).close()
        self.write(batches)
        return batches

    def write(self, batches_or_error):
        if isinstance(batches_or_error, str):
            manifest = {"error": batches_or_error}
        else:
            files = transport.CallFiles(0)
            self.files.append(files)
            stored = store(batches_or_error, files)
            if self.structure is None and batches_or_error:
                self.structure = stored.parts
            manifest = {"bounds": stored.bounds, "leaves": [
                leaf.path if isinstance(leaf, transport.Leaf) else None
                for leaf in keras.tree.flatten(stored.parts)]}
        name = f"{self.prefix}{self.count}"
        tmp = transport.private_file(os.path.join(self.path, f".{name}"))
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, os.path.join(self.path, f"{name}.json"))
        self.count += 1

    def close(self):
        for files in self.files:
            files.close()
        self.files = []


class Feed:
    """On a pool's driver: fit's data read for the workers, in Keras's order.

    The training data is read once per epoch, the validation data once per
    validation (from its iterator reset, as Keras's evaluate reads it). Pass 0 of
    each is read now (the training data's fixes the steps per epoch); a thread reads
    epoch ``e``'s passes (training, then validation if ``e`` validates) once rank 0
    has begun epoch ``e - 1`` (``NextPass``), so at most two passes of each exist at
    a time.

    Args:
        files: the call's ``transport.CallFiles`` (this feed's folder lives there).
        passes: how many epochs the fit runs.
        train: (x, steps_per_epoch, the user's model) or None: training data to read
            (Keras's fit builds the model from its iterator first).
        validation: (validation_data, validation_steps, the epochs that validate,
            counted from the fit's first) or None.
        draws: (a function, the epochs that validate) for arrays validating the
            training data (the ranks index them): it draws from torch's global
            generator what such a validation draws in Keras, after its epoch's pass
            (``data_fixes.validation_draws``); or None.
    """

    def __init__(self, files, passes, train=None, validation=None, draws=None):
        self.path = os.path.join(files.path, "feed")
        os.mkdir(self.path, 0o700)
        self.passes, self.steps = passes, None
        self.train = self.validation = self._thread = None
        self._stop = threading.Event()
        self._later = []  # the epochs after the first that read validation data
        self._draw, self._drawn = draws if draws is not None else (None, [])
        try:
            if train is not None:
                x, steps_per_epoch, build = train
                self.train = _Stream(self.path, "pass", data_fixes.epoch_iterator(
                    x, steps_per_epoch, build), "the training data for epoch", False)
                self.steps = len(self.train.read())
                if not self.steps:
                    raise ValueError("kmgpu (torch): the training data yielded no batch.")
            if validation is not None:
                data, steps, epochs = validation
                self.validation = _Stream(self.path, "vpass", data_fixes.epoch_iterator(
                    data, steps), "the validation data for validation", True)
                self.validation.read()
                self._later = list(epochs)[1:]
            if 0 in self._drawn:
                self._draw()
        except BaseException:
            self.close()
            raise
        if passes > 1:
            self._thread = threading.Thread(target=self._produce, daemon=True,
                                            name="kmgpu-feed")
            self._thread.start()

    def remote(self):
        """What the workers get: (training data, validation data), each a
        StreamedBatches over this feed's folder or None."""
        train = validation = None
        if self.train is not None:
            train = StreamedBatches(self.path, self.steps, self.train.structure)
        if self.validation is not None:
            validation = StreamedBatches(self.path, None, self.validation.structure,
                                         "vpass")
        return train, validation

    def _produce(self):
        stream = None
        try:
            for epoch in range(1, self.passes):
                begun = os.path.join(self.path, f"begun{epoch - 1}")
                while not os.path.exists(begun):
                    if self._stop.wait(0.01):
                        return
                for stream in (self.train, self.validation if epoch in self._later else None):
                    if stream is not None:
                        stream.read()
                if epoch in self._drawn:
                    self._draw()
        except BaseException as e:  # the ranks raise it when they reach this pass
            if not self._stop.is_set() and stream is not None:
                try:
                    stream.write(f"kmgpu (torch): reading {stream.what} {stream.count + 1} "
                                 f"failed: {type(e).__name__}: {e}")
                except OSError:
                    pass

    def close(self):
        """Stop reading; remove every pass's files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for stream in (self.train, self.validation):
            if stream is not None:
                stream.close()

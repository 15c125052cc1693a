"""The user's data on the torch ranks: what is accepted, how it travels, how it is cut.

Driver side: ``check`` refuses what the ranks cannot slice, ``send`` turns a call's
data into files for the pool's workers (``transport.CallFiles``), ``local`` keeps
it in-process under torchrun, ``assemble`` puts the ranks' predictions back in order.

Rank side: every rank sees the full arrays (memory-mapped in a pool worker, the
script's own arrays under torchrun) and feeds Keras a ``keras.utils.PyDataset``
(``RankSlices``) that yields, for global batch ``s``, the rank's contiguous slice
of it (sizes differ by at most one row). Every rank therefore runs the same number
of steps. A rank whose slice of a small last batch is empty gets one stand-in row
and a weight of zero, so it still joins every collective.

What a dataset is follows kmgpu's one rule (``datasets.is_dataset``). A
``keras.utils.PyDataset`` is indexed by every rank; any other dataset (``tf.data``, a
generator, a DataLoader) is read for the ranks by ``feeds``; everything else must be
arrays (NumPy, torch tensors, or lists/dicts of them).
"""

import math
import pickle

import keras
import numpy as np

from kmgpu.engines.datasets import is_dataset
from kmgpu.engines.torch import data_fixes, transport
from kmgpu.engines.torch.data import feeds, shuffle

#: the call arguments that hold data
DATA_KEYS = ("x", "y", "sample_weight", "validation_data")
#: a PyDataset is pickled to the workers up to this size; else read here and stored
PICKLE_LIMIT = 16 << 20


def _is_array_like(x):
    if x is None or isinstance(x, np.ndarray) or hasattr(x, "__array__"):
        return True
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return True
    if isinstance(x, (list, tuple, dict)):
        return all(_is_array_like(leaf) or np.isscalar(leaf) for leaf in keras.tree.flatten(x))
    return False


def check(name, x):
    """Raise TypeError unless ``x`` is arrays or a dataset (what the ranks can be fed)."""
    if is_dataset(x) or _is_array_like(x):
        return
    raise TypeError(
        f"kmgpu (torch): {name} is a {type(x).__name__}. kmgpu's torch workers take NumPy "
        "arrays (or torch tensors, lists/dicts of them) or a dataset (keras.utils.PyDataset, "
        "tf.data.Dataset, a generator, a torch DataLoader). Convert the data to arrays."
    )


# -- driver side ----------------------------------------------------------------------
def nbytes(kwargs):
    """About how many bytes of arrays a call's data holds (datasets not counted)."""
    total = 0
    for key in DATA_KEYS:
        value = kwargs.get(key)
        if value is None or isinstance(value, bytes) or is_dataset(value):
            continue
        try:
            for leaf in keras.tree.flatten(value):
                total += int(getattr(leaf, "nbytes", 0) or 0)
        except Exception:
            pass
    return total


def _read_for_ranks(method, kwargs, make_feed, keep, template):
    """Replace the datasets the ranks cannot index (``feeds.reads_itself``) in a call's
    arguments. In fit, ``make_feed(passes, train, validation, draws)`` returns what
    replaces the training data (one pass per epoch, not shuffled: Keras does not
    shuffle these) and the validation data (one pass per validation); ``train`` is (x,
    steps_per_epoch, template) and ``validation`` (data, validation_steps, the epochs
    that validate, from the fit's first), each None where the ranks index the data.
    ``draws`` is (``data_fixes.validation_draws``, the epochs that validate) for
    arrays validating training data read here (else None): the reader makes Keras's
    draws from torch's global generator between its passes, in Keras's order.
    evaluate's and predict's ``x`` becomes ``keep(batches)`` of one pass (``steps``
    batches). The user's ``template`` is built from them as Keras's fit and evaluate
    build it."""
    out = dict(kwargs)
    x, vd = kwargs.get("x"), kwargs.get("validation_data")
    if method == "fit" and (feeds.reads_itself(x) or feeds.reads_itself(vd)):
        start = int(kwargs.get("initial_epoch", 0) or 0)
        epochs = int(kwargs.get("epochs", 1))
        train = validation = draws = None
        freq, steps = kwargs.get("validation_freq", 1), kwargs.get("validation_steps")
        validating = [e - start for e in range(start, epochs) if feeds.validates(e, freq)]
        if feeds.reads_itself(x):
            train = (x, out.pop("steps_per_epoch", None), template)
            out["shuffle"] = False
        if feeds.reads_itself(vd):
            validation = (vd, steps, validating)
        elif train is not None and vd is not None and not is_dataset(vd):
            batch = kwargs.get("validation_batch_size") or kwargs.get("batch_size")
            draws = (data_fixes.validation_draws(vd, batch, steps,
                                                  template.steps_per_execution), validating)
        x_out, vd_out = make_feed(max(epochs - start, 1), train, validation, draws)
        if train is not None:
            out["x"] = x_out
        if validation is not None:
            out["validation_data"] = vd_out
    elif feeds.reads_itself(x):
        out["x"] = keep(feeds.one_pass(x, kwargs.get("steps"),
                                       template if method == "evaluate" else None))
    return out


def send(kwargs, files, method, template):
    """A call's keyword arguments for the pool's workers.

    Args:
        kwargs: Keras's keyword arguments of the call.
        files: the call's ``transport.CallFiles``.
        method: "fit", "evaluate" or "predict".
        template: the user's model.

    Returns:
        (the same arguments with arrays as files, a PyDataset pickled (or stored) and
        other datasets read here; the ``feeds.Feed`` of fit's data or None).
        The caller closes the feed after the call.
    """
    made = []

    def make_feed(passes, train, validation, draws):
        made.append(feeds.Feed(files, passes, train, validation, draws))
        return tuple(None if r is None else pickle.dumps(r) for r in made[-1].remote())

    try:
        out = _read_for_ranks(method, kwargs, make_feed,
                              lambda batches: pickle.dumps(feeds.store(batches, files)),
                              template)
        for key in DATA_KEYS:
            value = out.get(key)
            if value is None or isinstance(value, bytes):
                continue
            check(key, value)
            if is_dataset(value):
                out[key] = _send_dataset(value, files)
            else:
                out[key] = files.put(tuple(value) if key == "validation_data" else value)
    except BaseException:
        for feed in made:
            feed.close()
        raise
    return out, (made[0] if made else None)


def _send_dataset(dataset, files):
    """A PyDataset for the workers: pickled (by reference, or by value with
    cloudpickle) when that works and is small; else read here once and stored as
    memory-mapped arrays (``StoredBatches``)."""
    try:
        blob = transport.dumps(dataset)
        if len(blob) <= PICKLE_LIMIT:
            return blob
    except Exception:
        pass
    batches = []
    for i in range(len(dataset)):
        batch = dataset[i]
        batches.append(tuple(batch) if isinstance(batch, (tuple, list)) else (batch,))
    return pickle.dumps(feeds.store(batches, files))


def receive(kwargs):
    """In a worker: the call's arguments as ``send`` sent them, ready for Keras."""
    kwargs = transport.resolve(kwargs)
    for key in ("x", "validation_data"):
        if isinstance(kwargs.get(key), bytes):
            kwargs[key] = pickle.loads(kwargs[key])
    return kwargs


def as_numpy(value):
    """In-process: torch tensors / array-likes as NumPy (a dataset untouched)."""
    if value is None or is_dataset(value):
        return value
    check("data", value)
    return keras.tree.map_structure(transport.as_array, value)


def local(kwargs, method, template, host):
    """In-process: a call's arguments for this rank: arrays as NumPy, datasets other
    than a PyDataset read here (each process has the same data), drawing on ``host``
    (a ``feeds.KerasDraws``)."""
    def make_feed(passes, train, validation, draws):
        return (None if train is None else feeds.LocalStream(
                    train[0], host, *train[1:], draws=draws),
                None if validation is None else feeds.LocalStream(
                    validation[0], host, validation[1], validation=True))

    reads = any(feeds.reads_itself(kwargs.get(k)) for k in ("x", "validation_data"))
    with host.active(reads):
        out = _read_for_ranks(method, kwargs, make_feed, feeds.Batches, template)
    return {k: (as_numpy(v) if k in DATA_KEYS else v) for k, v in out.items()}


def assemble(pieces):
    """Predictions in input order from every rank's ``messages.Predictions``."""
    n = sum(len(p.positions) for p in pieces)
    first = pieces[0].outputs
    flats = [keras.tree.flatten(p.outputs) for p in pieces]
    outputs = []
    for j, leaf in enumerate(flats[0]):
        leaf = np.asarray(leaf)
        full = np.empty((n,) + leaf.shape[1:], leaf.dtype)
        for p, flat in zip(pieces, flats):
            full[p.positions] = flat[j]
        outputs.append(full)
    return keras.tree.pack_sequence_as(first, outputs)


# -- rank side ------------------------------------------------------------------------
def split(n, world, rank):
    """Rows [lo, hi) of ``n`` that ``rank`` of ``world`` takes (contiguous, near-even)."""
    q, rem = divmod(n, world)
    lo = rank * q + min(rank, rem)
    return lo, lo + q + (1 if rank < rem else 0)


def keras_batch_size(n, steps=None):
    """The batch Keras's array adapter takes when none is given: ``n`` rows in ``steps``
    batches, else 32."""
    return math.ceil(n / steps) if steps else 32


def num_rows(structure):
    """The number of rows of a data structure (its first leaf's first axis)."""
    leaves = [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]
    return int(leaves[0].shape[0]) if leaves else 0


class ArraySource:
    """Full arrays (x, y, sample_weight structures) cut into global batches."""

    def __init__(self, x, y=None, sample_weight=None):
        self.parts = tuple(p for p in (x, y, sample_weight))
        while len(self.parts) > 1 and self.parts[-1] is None:
            self.parts = self.parts[:-1]
        self.n = num_rows(x)

    def num_batches(self, batch_size):
        return math.ceil(self.n / batch_size)

    def batch(self, s, batch_size, order):
        """The rows of global batch ``s``: a slice, or indices when shuffled."""
        lo, hi = s * batch_size, min(self.n, (s + 1) * batch_size)
        return (slice(lo, hi) if order is None else order[lo:hi]), hi - lo

    def take(self, rows):
        return keras.tree.map_structure(
            lambda a: None if a is None else np.ascontiguousarray(a[rows]), self.parts
        )


class DatasetSource:
    """A user's ``keras.utils.PyDataset``: its batches are the global batches, each
    passing ``guard`` (``batch_checks.Guard``; None: none) as it is read, ``what`` naming
    the data in its error. Every rank reads the same global batch: all refuse it alike."""

    def __init__(self, dataset, guard=None, what="the data"):
        self.dataset, self.guard, self.what = dataset, guard, what

    def num_batches(self, batch_size):
        return len(self.dataset)

    def batch(self, s, batch_size, order):
        index = s if order is None else int(order[s])
        data = self.dataset[index]
        if isinstance(data, np.ndarray) or not isinstance(data, (tuple, list)):
            data = (data,)
        self._data = tuple(data)
        if self.guard is not None:
            self.guard(self._data, f"batch {s} of {self.what}")
        return slice(0, num_rows(self._data[0])), num_rows(self._data[0])

    def take(self, rows):
        return keras.tree.map_structure(
            lambda a: None if a is None else np.ascontiguousarray(np.asarray(a)[rows]),
            self._data,
        )


def source_of(x, y=None, sample_weight=None, guard=None, what="the data"):
    """The global batches of a call's data: a DatasetSource (read through ``guard``) or
    an ArraySource (arrays are checked whole before the call)."""
    if is_dataset(x):
        return DatasetSource(x, guard, what)
    return ArraySource(x, y, sample_weight)


class RankSlices(keras.utils.PyDataset):
    """This rank's contiguous slice of every global batch, as a Keras PyDataset.

    ``current`` is (real rows here, rows in the global batch) of the batch handed
    out last; Keras's torch trainer fetches a batch right before it runs the step
    on it (no prefetch with ``workers=1``), so the step reads it from here.

    Args:
        source: an ArraySource or DatasetSource.
        batch_size: the global batch (ignored by a DatasetSource).
        rank: this rank.
        world: the number of ranks.
        shuffle: False, True, or "batch": Keras's order (``shuffle.order``), drawn from
            this process's random states (the driver's, sent with the call: the same
            on every rank).
    """

    def __init__(self, source, batch_size, rank, world, shuffle=False):
        super().__init__()
        self.source, self.batch_size = source, batch_size
        self.rank, self.world = rank, world
        self.shuffle = shuffle
        self.current = (0, 0)
        self._passes = 0
        self._order = None

    def __len__(self):  # a validation pass read for the ranks has its own length
        return self.source.num_batches(self.batch_size)

    def next_pass(self):
        """Fit's validation begins: data read for the ranks moves to its next pass."""
        dataset = getattr(self.source, "dataset", None)
        if hasattr(dataset, "next_pass"):
            dataset.next_pass()

    def on_epoch_begin(self):
        self._passes += 1
        if isinstance(self.source, DatasetSource):  # as Keras calls it on one device
            self.source.dataset.on_epoch_begin()

    def on_epoch_end(self):
        if isinstance(self.source, DatasetSource):
            self.source.dataset.on_epoch_end()

    def _new_order(self):
        # Keras's own draws (``shuffle.order``); every rank starts the call from the
        # driver's random states, so the permutation is the same on every rank.
        if isinstance(self.source, DatasetSource):
            return shuffle.order(None, None, self.shuffle, batches=len(self))
        return shuffle.order(self.source.n, self.batch_size, self.shuffle)

    def steps_rows(self, s):
        """(lo, hi) within the global batch ``s`` for this rank, and its size."""
        _, n_global = self._global(s)
        return split(n_global, self.world, self.rank), n_global

    def _global(self, s):
        return self.source.batch(s, self.batch_size, self._order)

    def __getitem__(self, s):
        if s == 0 and self.shuffle:
            self._order = self._new_order()
        rows, n_global = self._global(s)
        lo, hi = split(n_global, self.world, self.rank)
        n_real = hi - lo
        if n_real == 0:  # stand-in row, weight 0: the rank still joins the collectives
            lo, hi = 0, 1
        if isinstance(rows, slice):
            local = slice(rows.start + lo, rows.start + hi)
        else:
            local = rows[lo:hi]
        self.current = (n_real, n_global)
        return self.source.take(local)


def predict_positions(n, batch_size, world, rank, steps):
    """Where this rank's predict rows go in the output, and which of them are real.

    Returns:
        (keep: bool array over the rows this rank predicted, positions: int array).
    """
    keep, where = [], []
    for s in range(steps):
        g_lo = s * batch_size
        n_global = min(n, g_lo + batch_size) - g_lo
        lo, hi = split(n_global, world, rank)
        if hi > lo:
            keep.append(np.ones(hi - lo, bool))
            where.append(np.arange(g_lo + lo, g_lo + hi))
        else:
            keep.append(np.zeros(1, bool))
    return np.concatenate(keep), (np.concatenate(where) if where else np.zeros(0, int))


def dataset_positions(slices, steps):
    """``predict_positions`` for a PyDataset (batch sizes read from ``slices``)."""
    keep, where, offset = [], [], 0
    for s in range(steps):
        (lo, hi), n_global = slices.steps_rows(s)
        if hi > lo:
            keep.append(np.ones(hi - lo, bool))
            where.append(np.arange(offset + lo, offset + hi))
        else:
            keep.append(np.zeros(1, bool))
        offset += n_global
    return np.concatenate(keep), (np.concatenate(where) if where else np.zeros(0, int))

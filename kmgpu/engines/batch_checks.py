"""What every batch must hold for the replicas to weigh a loss as one device, on
TensorFlow and torch.

Under "mean_with_sample_weight" each replica's share of the loss is weighed by one set of
sample-weight sums, so per-output sample weights must be one set for every output.
``check_weighable`` checks a call's arrays whole and a dataset's first batch before any
work. A dataset's later batches reach kmgpu's own code one by one (torch: each rank's
``inputs.DatasetSource``; TensorFlow: the per-replica feed of a generator, a PyDataset or a
torch DataLoader, one worker or several, and a ``tf.data`` dataset mapped through
``tensorflow.data.checked``), and each gets the same check there (``Guard``), on the
host, before its step runs. A refused batch raises ``BatchRefused`` naming it; the call
ends there, and after fit the user's model holds the state of the last completed step,
as after any error.

A model's own losses (``add_loss``) need no check: a layer that adds one runs on the
global batch (``global_losses``). JAX computes the loss on the global batch and needs
none of this.
"""

from kmgpu.engines import loss_fixes


class BatchRefused(NotImplementedError):
    """A batch the replicas cannot weigh as one device; the call stops before its step."""


def differing(sample_weight):
    """True when ``sample_weight`` holds per-output weights that are not one set: arrays
    that differ, or some outputs weighted and others not."""
    import keras
    import numpy as np

    if not isinstance(sample_weight, (list, tuple, dict)):
        return False
    leaves = keras.tree.flatten(sample_weight)
    given = [w for w in leaves if w is not None]
    if given and len(given) < len(leaves):
        return True
    return any(not np.array_equal(np.asarray(given[0]), np.asarray(w)) for w in given[1:])


WEIGHTS_TEXT = (
    "per-output sample weights that differ, with the 'mean_with_sample_weight' reduction: "
    "each replica's share of the loss is weighed by one set of sample weights, so the result "
    "would differ from one device. Pass one sample_weight array for every output (in every "
    "batch), give the losses another reduction (e.g. 'sum_over_batch_size'), or use the JAX "
    "backend (it computes the loss on the global batch).")


def check_weighable(model, kwargs, method="fit"):
    """Refuse, before any work, a call whose losses the replicas cannot weigh as one device
    does: per-output sample weights that differ under "mean_with_sample_weight" (each
    replica's part of the loss is weighed by one output's weight sums), given as arrays or
    in the first batch of a dataset. A dataset's later batches are checked as they arrive
    (``guard``).

    Returns:
        ``kwargs``; a generator peeked at is replaced by one that yields all its batches.
    """
    if method in ("predict", "predict_on_batch") or loss_fixes.loss_kind(model) != "weights":
        return kwargs
    given = kwargs.get("sample_weight")
    if given is None:
        kwargs, batch = first_batch(kwargs, whole=method.endswith("_on_batch"))
        if batch is not None:
            given = batch[2]
    if differing(given):
        raise NotImplementedError(f"kmgpu: {WEIGHTS_TEXT}")
    return kwargs


def guard(model, method, replicas):
    """The per-batch check of a call of ``method`` on ``model`` split over ``replicas``
    (a ``Guard``), or None when no batch needs one (one replica, predict, a model not
    compiled, a loss not reduced by "mean_with_sample_weight")."""
    if replicas < 2 or method in ("predict", "predict_on_batch") or not model.compiled:
        return None
    return Guard() if loss_fixes.loss_kind(model) == "weights" else None


class Guard:
    """Checks one batch at a time (``__call__``); ``error`` keeps the first refusal it
    raised (a data pipeline may hand it on as its own error type, and read on)."""

    def __init__(self):
        import threading

        self.error = None
        self._lock = threading.Lock()  # one check at a time, whichever thread reads data

    def __call__(self, batch, where):
        """Check ``batch`` ((x, y, sample_weight) or Keras's packed form), named
        ``where`` in the error (e.g. "batch 3 of the training data").

        Raises:
            BatchRefused: its per-output sample weights differ.
        """
        import keras

        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        _, _, sw = keras.utils.unpack_x_y_sample_weight(batch)
        with self._lock:
            if not differing(sw):
                return
            if self.error is not None:  # tf.data reads on past a failed element
                raise self.error from None
            self.error = BatchRefused(
                f"kmgpu: {where} is refused, the batches before it were not: {WEIGHTS_TEXT} "
                "The call stopped before that batch's step; after fit your model holds the "
                "state of the last completed step.")
            raise self.error from None


# -- the first batch of a call, for the checks before any work ---------------------------
def first_batch(kwargs, whole=False):
    """The first batch of a call's data as (x, y, sample_weight), read without changing
    what the call will read: arrays sliced (``batch_size`` rows, or all of them for
    ``whole``: the ``*_on_batch`` methods), a PyDataset's item 0, a ``tf.data`` dataset's
    first element (a new iterator, as Keras's own build takes it), a map-style torch
    ``DataLoader``'s first batch collated from its dataset, and a generator's first
    batch, given back in front of the rest.

    Returns:
        (kwargs, with a generator peeked at replaced by one that yields that batch
        first; the batch, or None for data it cannot read so, e.g. an iterable torch
        dataset).
    """
    import inspect

    import keras

    from kmgpu.engines.datasets import is_dataset

    x = kwargs.get("x")
    if x is None:
        return kwargs, None
    if not is_dataset(x):
        rows = None if whole else int(kwargs.get("batch_size") or 32)
        batch = tuple(keras.tree.map_structure(lambda a: a[:rows], kwargs.get(key))
                      if kwargs.get(key) is not None else None
                      for key in ("x", "y", "sample_weight"))
        return kwargs, batch
    try:
        if isinstance(x, keras.utils.PyDataset):
            batch = x[0]
        elif hasattr(x, "element_spec") and hasattr(x, "take"):  # tf.data
            batch = next(iter(x.take(1)))
        elif hasattr(x, "collate_fn") and hasattr(x, "dataset"):  # torch DataLoader
            size = x.batch_size
            if not size or not hasattr(x.dataset, "__getitem__"):
                return kwargs, None
            batch = x.collate_fn([x.dataset[i] for i in range(min(size, len(x.dataset)))])
        elif inspect.isgenerator(x) or hasattr(x, "__next__"):
            batch = next(x)
            kwargs = dict(kwargs, x=_in_front(batch, x))
        else:
            return kwargs, None
    except (StopIteration, IndexError, TypeError):
        return kwargs, None
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
    return kwargs, tuple(None if part is None else keras.tree.map_structure(_numpy, part)
                         for part in (x, y, sw))


def _in_front(first, rest):
    yield first
    yield from rest


def _numpy(a):
    import numpy as np

    if hasattr(a, "detach"):  # torch
        a = a.detach().cpu()
    return np.asarray(a)

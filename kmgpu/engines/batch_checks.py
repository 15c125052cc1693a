"""What every batch of a dataset must hold for the replicas to weigh a loss as one device.

``check_weighable`` checks a call's arrays whole and a dataset's first batch
before any work. A dataset's later batches reach kmgpu's own code one by one (torch: each
rank's ``data.DatasetSource``; TensorFlow: the per-replica feed of a generator, a
PyDataset or a torch DataLoader, one worker or several, and a ``tf.data`` dataset mapped
through ``tensorflow.data.checked``), and each gets the same check there (``Guard``), on
the host, before its step runs (a stateful RNN model too: ``loss_rows.probe``):

- under "mean_with_sample_weight", its per-output sample weights are one set for every
  output (each replica's share of the loss is weighed by one set of weight sums);
- a model whose own losses are probed (``loss_rows``): a row count not seen before is
  probed, and a rule other than the one the step applies is refused.

A refused batch raises ``BatchRefused`` naming it; the call ends there, and after fit
the user's model holds the state of the last completed step, as after any error.
JAX computes the loss on the global batch and needs none of this.
"""

from kmgpu.engines import keras_fixes, loss_rows


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


def check_weighable(model, kwargs, method="fit", replicas=2, rule="even"):
    """Refuse, before any work, a call whose losses the replicas cannot weigh as one device
    does: outputs whose losses reduce differently (``loss_kind``); per-output sample
    weights that differ under "mean_with_sample_weight" (each replica's part of the loss
    is weighed by one output's weight sums): given as arrays, or in the first batch of a
    dataset; a model's own loss (``add_loss``) that is neither a mean nor a sum over rows
    (``loss_rows``, probed on the first batch and, for arrays, on the last partial one of
    the training and validation data, split over ``replicas`` by ``rule``
    (``loss_rows.split_sizes``); also for predict so that
    every replica is made with the probe's rules). A dataset's later batches are checked
    as they arrive (``batch_checks``).

    Returns:
        ``kwargs``; a generator peeked at is replaced by one that yields all its batches.
    """
    from kmgpu.checks import is_dataset

    uses_loss = method not in ("predict", "predict_on_batch")
    weights = uses_loss and keras_fixes.loss_kind(model) == "weights"
    # a dataset's first batch is read once per model (its later batches, and those of
    # later calls, are checked as they arrive); arrays' batches are slices: every call
    probe = loss_rows.needs_probe(model) and (
        loss_rows.rules(model, True) is None or (uses_loss and not is_dataset(kwargs.get("x"))))
    if not (weights or probe):
        loss_rows.check(model, None, uses_loss)  # a loss refused on an earlier call
        return kwargs
    given, batch = kwargs.get("sample_weight"), None
    if probe or (weights and given is None):
        kwargs, batch = loss_rows.first_batch(kwargs, whole=method.endswith("_on_batch"))
    if weights:
        if given is None and batch is not None:
            given = batch[2]
        if differing(given):
            raise NotImplementedError(f"kmgpu: {WEIGHTS_TEXT}")
    loss_rows.check(model, batch[0] if batch is not None else None, uses_loss, replicas,
                    rule=rule)
    if probe and not method.endswith("_on_batch"):
        for x in array_batches(kwargs):
            loss_rows.check(model, x, uses_loss, replicas, rule=rule)
    return kwargs


def array_batches(kwargs):
    """The first and the last (partial) batch of a call's training arrays and of fit's
    validation arrays (``validation_split`` or ``validation_data``): every row count
    their batches have (none for a dataset)."""
    import math

    import keras

    from kmgpu.checks import is_dataset

    x, size = kwargs.get("x"), int(kwargs.get("batch_size") or 32)
    if x is None or is_dataset(x):
        return []
    vsize = int(kwargs.get("validation_batch_size") or size)
    n = loss_rows.num_rows(x)
    sources = [(x, 0, n, size)]
    if kwargs.get("validation_split") and kwargs.get("validation_data") is None:
        cut = int(math.floor(n * (1.0 - kwargs["validation_split"])))
        sources = [(x, 0, cut, size), (x, cut, n, vsize)]
    validation = kwargs.get("validation_data")
    if isinstance(validation, (tuple, list)) and validation and not is_dataset(validation[0]):
        sources.append((validation[0], 0, loss_rows.num_rows(validation[0]), vsize))
    out = []
    for data, lo, hi, rows in sources:
        for start in {lo, hi - (hi - lo) % rows if (hi - lo) % rows else lo}:
            if start < hi:
                out.append(keras.tree.map_structure(
                    lambda a, s=slice(start, min(hi, start + rows)): a[s], data))
    return out


def guard(model, method, replicas):
    """The per-batch check of a call of ``method`` on ``model`` split over ``replicas``
    (a ``Guard``), or None when no batch needs one (one replica, predict, a model not
    compiled, nothing to weigh)."""
    if replicas < 2 or method in ("predict", "predict_on_batch") or not model.compiled:
        return None
    weights = keras_fixes.loss_kind(model) == "weights"
    probe = loss_rows.needs_probe(model)
    return Guard(model, replicas, weights, probe) if weights or probe else None


class Guard:
    """Checks one batch at a time (``__call__``); ``error`` keeps the first refusal it
    raised (a data pipeline may hand it on as its own error type, and read on)."""

    def __init__(self, model, replicas, weights, probe):
        import threading

        self.model, self.replicas, self.weights, self.probe = model, replicas, weights, probe
        self.error = None
        self._lock = threading.Lock()  # one check at a time, whichever thread reads data

    def known_rows(self, rule="even"):
        """The row counts whose split by ``rule`` was probed already (none to probe)."""
        return sorted({sum(key) for key in loss_rows.probed_splits(self.model)
                       if tuple(loss_rows.split_sizes(sum(key), self.replicas, rule)) == key})

    def __call__(self, batch, where, rule="even"):
        """Check ``batch`` ((x, y, sample_weight) or Keras's packed form), named
        ``where`` in the error (e.g. "batch 3 of the training data"), split over the
        replicas by ``rule`` (``loss_rows.split_sizes``).

        Raises:
            BatchRefused: the batch breaks a rule above.
        """
        import keras

        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        x, _, sw = keras.utils.unpack_x_y_sample_weight(batch)
        with self._lock:
            self._check(x, sw, where, rule)

    def _check(self, x, sw, where, rule):
        try:
            if self.weights and differing(sw):
                raise NotImplementedError(f"kmgpu: {WEIGHTS_TEXT}")
            if self.probe and x is not None and not loss_rows.probed(
                    self.model, loss_rows.num_rows(x), self.replicas, rule):
                loss_rows.check(self.model, x, True, self.replicas, late=True, rule=rule)
        except NotImplementedError as e:
            if self.error is not None:  # tf.data reads on past a failed element
                raise self.error from None
            self.error = BatchRefused(
                f"kmgpu: {where} is refused, the batches before it were not: {str(e)[7:]} The call "
                "stopped before that batch's step; after fit your model holds the state of "
                "the last completed step.")
            raise self.error from None

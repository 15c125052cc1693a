"""Each replica's part of the global batch's loss, by Keras's own loss code: the one rule
every engine weighs a replica's loss and its loss trackers by (``replica_loss``), and the
wrap of Keras's masked reductions it needs. Rows of ``kmgpu/engines/keras_fixes.py``.
"""

import threading

from kmgpu.engines import keras_fixes

#: Keras's loss reductions, by what one device divides the batch's summed loss by
_KINDS = {"sum_over_batch_size": "rows", "mean": "rows", "mean_with_sample_weight": "weights",
          "sum": "sum", None: "none", "none": "none"}


def loss_kind(model):
    """How the replicas' losses add up to one device's loss of the global batch, from
    the reduction of the model's compiled losses: "rows" (a mean over rows: Keras's
    default, "mean", a plain function, a model's own ``compute_loss``), "weights"
    ("mean_with_sample_weight": divided by the sum of the sample weights), "sum" or
    "none" (not reduced: a loss per row).

    Raises:
        ValueError: the outputs' losses reduce differently (kmgpu weighs one loss).
    """
    import keras
    from keras.src.trainers.trainer import Trainer

    if type(model).compute_loss is not Trainer.compute_loss:
        return "rows"  # the model's own compute_loss: taken as a mean over rows
    found = {}
    for loss in keras.tree.flatten(getattr(model, "loss", None)):
        if loss is not None:
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            found.setdefault(_KINDS.get(reduction, "rows"), reduction)
    if len(found) > 1:
        raise ValueError(
            f"kmgpu: the model's losses reduce differently ({sorted(map(str, found.values()))}):"
            " each replica's loss is weighed by one rule, so give every output's loss the "
            "same reduction (e.g. all 'sum_over_batch_size', the default).")
    return next(iter(found), "rows")


def replica_share(kind, rows, global_rows, weights=None, global_weights=None):
    """This replica's weight in the global batch's loss: one device's loss is the sum
    over replicas of ``share * (the replica's loss of its own rows)``, and so is its
    gradient. The one rule every engine weighs a replica's loss by.

    Args:
        kind: ``loss_kind(model)``.
        rows, global_rows: real rows of this replica's batch, and of the global batch.
        weights, global_weights: the sums of the sample weights here and over all
            replicas ("weights" only; None: no sample weights, a mean over rows).
            A zero global sum is the caller's to replace by 1 (every loss is 0 then).

    Returns:
        ``rows / global_rows`` for a mean over rows, ``weights / global_weights`` for
        "mean_with_sample_weight" with sample weights, 1 for a sum (or an unreduced
        loss, whose gradient is that of its sum). Plain arithmetic: numbers or tensors.
    """
    if kind in ("sum", "none"):
        return 1.0
    if kind == "weights" and weights is not None:  # tensors
        return weights / global_weights
    return rows / global_rows


def tracker_update(kind, local, part, rows, global_rows):
    """(value, weight) a replica updates a loss tracker (a ``keras.metrics.Mean``) with,
    so that summed over replicas the tracker holds what one device adds for the global
    batch (its loss, with weight ``global_rows``).

    Args:
        kind: ``loss_kind(model)``.
        local: the replica's loss of its own rows, as one device computes it (for
            "none", the mean of its per-row losses: what a ``Mean`` makes of them).
        part: the replica's part of the global loss (``replica_share * local``).
        rows, global_rows: real rows here (> 0: a replica without rows adds nothing)
            and in the global batch.
    """
    if kind in ("rows", "none"):
        return local, rows
    return part * (global_rows / rows), rows


def replica_loss(model, x, y, y_pred, sample_weight, training, rows, global_rows,
                 sum_weights, keras_scale=1):
    """This replica's loss, as one device computes it for its rows, and its part of
    the global batch's loss (``replica_share``).

    Keras's own ``compute_loss`` is the compiled loss plus the model's own losses
    (regularizers, ``add_loss``); the compiled loss weighs by ``replica_share``, the
    model's own by rows (one device adds them once per batch). A model's own
    ``compute_loss`` is taken as a mean over rows.

    Args:
        model, x, y, y_pred, sample_weight, training: as ``Trainer.compute_loss``.
        rows, global_rows: real rows here and in the global batch (tensors or numbers).
        sum_weights: ``sum_weights(w)`` is the scalar ``w`` summed over replicas (called
            only for "mean_with_sample_weight" with sample weights).
        keras_scale: what Keras divided a mean reduction and the model's own losses by
            (tf.distribute: the number of replicas). The model's own losses are read
            from ``model.losses`` (TensorFlow's replica threads each keep their own:
            ``tensorflow.layer_fixes.per_thread_losses``).

    Returns:
        (kind, local loss, part of the global loss).
    """
    import keras
    from keras import ops
    from keras.src.trainers.trainer import Trainer

    own_losses = list(model.losses)
    fraction = (rows / global_rows if isinstance(rows, (int, float))
                else ops.cast(rows, "float32") / ops.cast(global_rows, "float32"))
    own_terms = _own_terms(model, own_losses, rows, keras_scale)
    if type(model).compute_loss is Trainer.compute_loss and model._compile_loss is None \
            and own_losses:  # add_loss alone: weighed as the model's own losses below
        local = sum(own_terms[1:], own_terms[0])
        return "rows", local, _times(local, fraction)
    if type(model).compute_loss is not Trainer.compute_loss or model._compile_loss is None:
        local = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training) * keras_scale
        return "rows", local, _times(local, fraction)
    kind = loss_kind(model)
    weights = global_weights = None
    if kind == "weights" and sample_weight is not None:
        # one array for every output (Keras repeats it per output on TF); weights that
        # differ per output would need a share per output: the first one's is taken
        leaves = [w for w in keras.tree.flatten(sample_weight) if w is not None]
        weights = ops.sum(ops.cast(leaves[0], "float32"))
        global_weights = sum_weights(weights)
        global_weights = ops.where(global_weights == 0, 1.0, global_weights)
    share = replica_share(kind, fraction, 1.0, weights, global_weights)
    _weigh_output_trackers(model)
    factor = None  # what an output's loss tracker's value is multiplied by
    if kind != "rows":
        factor = 1.0 / keras_scale if kind == "none" else _times(
            share * global_rows / (max(rows, 1) if isinstance(rows, (int, float))
                                   else ops.maximum(rows, 1)),
            1.0 if kind == "weights" else 1.0 / keras_scale)
    if isinstance(rows, (int, float)) and not rows:  # a stand-in row (torch): none counts
        factor = 0
    _STEP.factor = factor
    masked_losses()
    _STEP.masked = (sum_weights, share) if kind in ("rows", "weights") else None
    try:
        local = part = model._compile_loss(y, y_pred, sample_weight)
    finally:
        _STEP.factor = _STEP.masked = None
    if kind in ("rows", "weights"):
        local = part = local * keras_scale
    if kind != "none":
        part = _times(local, share)
    for own in own_terms:
        local, part = local + own, part + (own if kind == "none" else _times(own, fraction))
    return kind, local, part


def _own_terms(model, own_losses, rows, keras_scale):
    """The model's own losses, each the global batch's value: a layer written outside
    Keras that adds one runs on the global batch (``global_losses``); Keras's own layers
    add means over rows (activity regularizers, divided by the batch size), and weight
    regularizers do not depend on the rows. So a replica's part of each is its share of
    the rows."""
    return [_without_rows(model._aggregate_additional_loss(own) * keras_scale, rows)
            for own in own_losses]


def _without_rows(own, rows):
    """A model's own loss, 0 on a replica without rows (TensorFlow's split of a small last
    batch; a mean over no rows is NaN, and NaN * 0 is NaN in the loss tracker)."""
    from keras import ops

    if isinstance(rows, (int, float)):
        return own
    return ops.where(ops.cast(rows, "float32") > 0, own, ops.zeros_like(own))


_STEP = threading.local()  # TF replicas trace their steps in threads


def masked_losses():
    """Wrap Keras's ``reduce_weighted_values`` (once, for good) so that, within
    ``replica_loss``, a loss with a mask (``Embedding(mask_zero=True)``, ``Masking``, a
    layer's own ``compute_mask``) reduced as a mean weighs as one device's: Keras divides
    the replica's summed loss by its own valid entries ``D_r`` (sample weights of valid
    entries for "mean_with_sample_weight"), one device by those of the whole batch
    ``D``. The replica's value is multiplied by ``D_r / (D * share)``, so that
    ``replica_loss``'s ``share *`` it is the replica's part ``S_r / D``; each output
    its own ``D``. Outside ``replica_loss``, and for losses without a mask, Keras's own.
    """
    from keras.src.losses import loss as losses

    keras_fixes.install(losses, "reduce_weighted_values", _masked_reduction,
                        key="masked_losses")


def _masked_reduction(original):
    """Keras's ``reduce_weighted_values`` (``original``), reweighted within ``replica_loss``."""
    from keras import ops
    from keras.src.losses import loss as losses

    def reduce_weighted_values(values, sample_weight=None, mask=None,
                               reduction="sum_over_batch_size", dtype=None):
        value = original(values, sample_weight, mask, reduction, dtype)
        masked = getattr(_STEP, "masked", None)
        if masked is None or mask is None or reduction not in (
                "sum_over_batch_size", "mean", "mean_with_sample_weight"):
            return value
        sum_over_replicas, share = masked
        dtype = value.dtype
        if reduction == "mean_with_sample_weight":
            weights = losses.apply_mask(sample_weight, ops.convert_to_tensor(mask, dtype),
                                        dtype=dtype, reduction=reduction)
            _, weights = losses.squeeze_or_expand_to_same_rank(
                ops.convert_to_tensor(values, dtype=dtype), ops.cast(weights, dtype))
            here = ops.sum(ops.broadcast_to(weights, ops.shape(values))) \
                if sample_weight is not None else ops.sum(ops.cast(mask, dtype))
        else:
            here = ops.sum(ops.cast(mask, dtype))
        everywhere = ops.cast(sum_over_replicas(here), dtype)
        return value * ops.divide_no_nan(here, everywhere * ops.cast(share, dtype))

    return reduce_weighted_values


def _weigh_output_trackers(model):
    """A model with several outputs tracks each output's loss (``CompileLoss.metrics``),
    with the replica's own value of it: within ``replica_loss`` each value is multiplied
    by ``_STEP.factor`` (``part * global_rows / rows``, over the Keras 1/N scaling a
    sum never had), so that a sum or a mean over sample weights adds up as one device's."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None or not compile_loss.built or not compile_loss.metrics:
        return

    def weighed(update_state):
        def update(values, sample_weight=None):
            factor = getattr(_STEP, "factor", None)
            if isinstance(factor, int) and factor == 0:
                values, sample_weight = values * 0, 0
            elif factor is not None:
                values = _times(values, factor)
            return update_state(values, sample_weight=sample_weight)
        return update

    for metric in compile_loss.metrics:
        keras_fixes.install(metric, "update_state", weighed, key="weigh_output_trackers")


def _times(tensor, factor):
    from keras import ops

    if isinstance(factor, (int, float)):
        return tensor * factor
    return tensor * ops.cast(factor, tensor.dtype)

"""A model with its own ``train_step`` / ``test_step`` on the torch ranks.

kmgpu's own steps weight each rank's loss by its share of the global batch. A
user's step (the Keras guide's pattern: ``compute_loss``, ``loss.backward()``,
``optimizer.apply``, a loss tracker updated with the loss) is kept as written, and
made equal to one device around it:

- ``optimizer.apply`` sums the ranks' gradients weighted by each rank's part of the
  global loss (``kmgpu.engines.loss_fixes.replica_share``: ``n_rank / n_global`` for
  a mean, 1 for a sum): the gradient of the global batch's loss, also when the last
  batch splits unevenly (a model's own losses, regularizers included, are taken to
  reduce like the compiled loss here);
- a loss tracker (a ``keras.metrics.Mean`` given one value per step, no weight)
  counts each rank's value (``tracker_update``) with weight ``N * n_rank / n_global``:
  summed over the ranks, it holds the mean over steps of the global batch's loss;
- a rank whose share of a small last batch is empty (one stand-in row) runs the
  step for the collectives, and its metrics are put back as they were after it.

The metric variables are summed over ranks before Keras reads them (``strategy``),
and logs a step returns under a metric's name are read from that metric.
"""

import keras
import torch

from kmgpu.engines.torch import collectives
from kmgpu.engines.torch.steps import batch_gather


class OwnSteps:
    """The rows of the step running now, for the hooks below.

    Args:
        strategy: the rank's ``DDPStrategy`` (its ``train`` / ``test`` RankSlices).
        average_statistics: ``average_statistics(variables, share)`` averages BatchNorm
            moving statistics over the ranks (``RankSteps.average_statistics``).
    """

    def __init__(self, strategy, average_statistics):
        self.strategy = strategy
        self.average_statistics = average_statistics
        self.rows = None  # (real rows here, rows in the global batch) inside a step
        self.share = None  # this rank's weight in the step's global loss, inside a step
        self.kind = "rows"  # how the model's loss reduces (kmgpu.engines.loss_fixes)

    def prepare(self, replica, averaged):
        """Install the hooks on ``replica`` (instance attributes; its class untouched).

        Args:
            replica: the rank's replica, with its own train_step or test_step.
            averaged: BatchNorm moving statistics to average after every update.
        """
        from kmgpu.engines import loss_fixes as common
        from kmgpu.engines.torch import step_fixes

        self.kind = common.loss_kind(replica) if replica.compiled else "rows"
        if step_fixes.has_own_train_step(replica):
            replica.train_step = self._step(replica, replica.train_step, "train")
            self._hook_optimizer(replica, averaged)
        if step_fixes.has_own_test_step(replica):
            replica.test_step = self._step(replica, replica.test_step, "test")
        for metric in replica.metrics:
            if type(metric) is keras.metrics.Mean:
                self._weigh(metric)

    def _current(self, which):
        slices = getattr(self.strategy, which)
        return slices.current if slices is not None else None

    def _step(self, replica, step, which):
        def own_step(data):
            rows = self._current(which)
            saved = None
            if rows is not None and rows[0] == 0:  # a stand-in row: keep it out
                saved = [(v, v.value.detach().clone()) for m in replica.metrics
                         for v in m.variables]
            self.rows, self.share = rows, self._share(replica, data, rows)
            try:
                with self._global_batch(which):
                    logs = step(data)
            finally:
                self.rows = self.share = None
            if saved is not None:
                with torch.no_grad():
                    for v, value in saved:
                        v.value.copy_(value)
            return logs

        return own_step

    def _global_batch(self, which):
        """Layers that add a loss run on the global batch (``global_losses``); each
        rank's step adds the global value whole and its gradients are weighed by
        ``share`` before they are summed (``batch_gather.RankBatch``'s ``weight``). The
        layer's own weights then get ``sum(share) = 1`` times the gradient: one device's
        for a mean ("rows", "weights"); a sum's shares are 1 each, so such a model is
        refused."""
        s = self.strategy
        if which == "test":
            return batch_gather.on_global(s.rank, s.world, self.rows, training=False)
        refuse = None
        if self.kind in ("sum", "none"):
            refuse = (f"the model has its own train_step with a compiled loss reduced by "
                      f"{self.kind!r}: each of the {s.world} ranks adds the global batch's "
                      "loss whole and its gradients count whole, so the layer's weights "
                      f"would get {s.world} times one device's gradient. Give the "
                      "compiled loss a mean reduction (the default), use Keras's own "
                      "train_step, or use the JAX backend.")
        return batch_gather.on_global(s.rank, s.world, self.rows, weight=self.share or 0.0,
                                      refuse=refuse)

    def _share(self, replica, data, rows):
        """This rank's weight in the step's global loss (``replica_share``, the rule of
        ``kmgpu.engines.loss_fixes``), or None outside a distributed call."""
        from kmgpu.engines import loss_fixes as common

        if rows is None or not rows[1]:
            return None
        n_real, n_global = rows
        kind, weights, total = self.kind, None, None
        sample_weight = keras.utils.unpack_x_y_sample_weight(data)[2]
        if kind == "weights" and sample_weight is not None:
            leaves = [w for w in keras.tree.flatten(sample_weight) if w is not None]
            weights = float(torch.sum(leaves[0].float())) if n_real else 0.0
            s = self.strategy
            total = float(collectives.sum_tensors([torch.tensor(weights)], s.device)[0]) or 1.0
        return common.replica_share(kind, n_real, n_global, weights, total) if n_real else 0.0

    def _weigh(self, metric):
        update = metric.update_state
        world = self.strategy.world

        def update_state(values, sample_weight=None):
            rows, share = self.rows, self.share
            if (rows is not None and sample_weight is None and rows[1] and share is not None
                    and len(getattr(values, "shape", ())) == 0):
                from kmgpu.engines import loss_fixes as common

                if rows[0]:
                    values, _ = common.tracker_update(self.kind, values, values * share,
                                                      rows[0], rows[1])
                sample_weight = rows[0] * world / rows[1]
            return update(values, sample_weight=sample_weight)

        metric.update_state = update_state

    def _hook_optimizer(self, replica, averaged):
        opt = getattr(replica, "optimizer", None)
        if opt is None:  # not compiled: predict only
            return
        apply, s = opt.apply, self.strategy

        def apply_synced(grads, trainable_variables=None):
            rows = self.rows or self._current("train")
            share = (self.share if self.share is not None
                     else rows[0] / rows[1] if rows and rows[1] else 1.0 / s.world)
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            sums = collectives.sum_tensors([grads[i] * share for i in present], s.device)
            for i, total in zip(present, sums):
                grads[i] = total
            result = apply(grads, trainable_variables)
            self.average_statistics(averaged, share)
            return result

        opt.apply = apply_synced

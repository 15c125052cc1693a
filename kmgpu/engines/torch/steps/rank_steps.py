"""The steps one torch rank's replica runs: Keras's train step through
DistributedDataParallel, kmgpu's split (captured) step, a model's own step, the test
step, and how a rank's loss and metrics join the other ranks'.

``RankSteps`` builds these steps for a ``strategy.DDPStrategy``, which prepares a
replica with them and runs one call (see ``strategy``'s docstring for how one global
batch becomes N equal steps).
"""

import contextlib

import keras
import torch
import torch.distributed as dist

from kmgpu.engines.torch import collectives
from kmgpu.engines.torch.data import inputs
from kmgpu.engines.torch.steps import batch_gather, own_steps


class RankSteps:
    """The step builders of one rank's ``DDPStrategy``. The steps read, when they run,
    the strategy's ``rank``, ``world``, ``device``, the ``train`` / ``test`` slices of the
    call running and whether its metrics are summed (``collective``), and its
    ``config``'s ``sync_batchnorm``, ``shard_optimizer`` and ``tf32``.

    Args:
        strategy: the rank's ``DDPStrategy``.
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.n_real = None  # real rows of this rank's current training batch
        self.in_train_step = False

    def train_rows(self):
        """The real rows of this rank's batch inside a train step's forward pass, else
        None (what sync BatchNorm weighs the rank's moments by)."""
        return self.n_real if self.in_train_step else None

    def average_statistics(self, variables, share):
        """Non-sync BatchNorm: moving statistics averaged over ranks, weighted by share."""
        s = self.strategy
        if not variables or s.world == 1:
            return
        with torch.no_grad():
            sums = collectives.sum_tensors([v.value * share for v in variables], s.device)
            for v, total in zip(variables, sums):
                v.value.copy_(total)

    def keras_step(self, replica, ddp, averaged):
        """Keras's train step with the forward pass through ``ddp`` (its gradients summed
        over ranks, each rank's loss weighed by its part of the global batch)."""
        s = self.strategy

        def train_step(batch):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            if s.train is None:
                raise RuntimeError(
                    "kmgpu: this replica trains only inside a distributed fit (a callback "
                    "on rank 0 cannot call fit on it)."
                )
            n_real, n_global = s.train.current
            self.n_real, self.in_train_step = n_real, True
            try:
                with batch_gather.on_global(s.rank, s.world, (n_real, n_global)):
                    if replica._call_has_training_arg:
                        y_pred = ddp(x, training=True)
                    else:
                        y_pred = ddp(x)
            finally:
                self.in_train_step = False
            replica.zero_grad()
            part = self.track_loss(replica, x, y, y_pred, sample_weight, True, n_real, n_global)
            share = n_real / n_global
            loss = replica.optimizer.scale_loss(part)
            trainable = replica.trainable_weights[:]
            loss.backward()  # DDP sums the weighted gradients over ranks
            gradients = [v.value.grad for v in trainable]
            with torch.no_grad():
                replica.optimizer.apply(gradients, trainable)
            self.average_statistics(averaged, share)
            if n_real:
                return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return replica.get_metrics_result()

        return train_step

    def captured_step(self, replica, averaged):
        """The split step of ``graphs`` (the default on GPUs, jit_compile=True on a CPU),
        captured as CUDA graphs on a GPU, eager on a CPU; its one collective is the flat
        gradient all-reduce.

        Returns:
            (the ``graphs.CapturedStep``, its ``SplitStep`` when the optimizer state is
            sharded over the ranks (ZeRO-1), else None).
        """
        from kmgpu.engines.torch.capture import graphs

        s = self.strategy

        def rows(x):
            if s.train is None:
                raise RuntimeError(
                    "kmgpu: this replica trains only inside a distributed fit (a callback "
                    "on rank 0 cannot call fit on it).")
            return s.train.current

        @contextlib.contextmanager
        def forward(n_real):
            self.n_real, self.in_train_step = n_real, True
            try:
                with batch_gather.on_global(s.rank, s.world, s.train.current):
                    yield
            finally:
                self.in_train_step = False

        def reduce(flats):
            for flat in flats:
                dist.all_reduce(flat)

        shard = s.config.shard if s.world > 1 else None
        split = graphs.SplitStep(replica, world=s.world, reduce=reduce if s.world > 1
                                 else None, averaged=averaged, rows=rows, forward=forward,
                                 rank=s.rank, shard=shard)
        refuse = None
        if s.config.sync_batchnorm and s.world > 1 and graphs.available(s.device):
            refuse = "sync_batchnorm all-reduces inside the forward pass"
        elif replica.run_eagerly:  # the split step for ZeRO-1 or added losses only: eager
            refuse = "compile(run_eagerly=True)"
        captured = graphs.CapturedStep(split, s.device, say=print if s.rank == 0 else None,
                                       refuse=refuse, tf32=s.config.tf32)
        return captured, split if shard else None

    def hook_own_steps(self, replica, averaged):
        """A model with its own ``train_step``: gradients summed in ``optimizer.apply``
        weighted by this rank's rows, its loss tracker likewise (``own_steps``)."""
        own_steps.OwnSteps(self.strategy, self.average_statistics).prepare(replica, averaged)

    def test_step(self, replica):
        """Keras's test step on this rank's rows, the loss weighed by its share."""
        s = self.strategy

        def test_step(batch):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            rows = s.test.current if s.test is not None else None
            n_real, n_global = rows or (inputs.num_rows(x),) * 2
            with batch_gather.on_global(s.rank, s.world, rows, training=False):
                if replica._call_has_training_arg:
                    y_pred = replica(x, training=False)
                else:
                    y_pred = replica(x)
            self.track_loss(replica, x, y, y_pred, sample_weight, False, n_real, n_global)
            if not n_real:
                return replica.get_metrics_result()
            return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        return test_step

    def sum_weights(self, n_real):
        """``sum_weights(w)``: a rank's sum of sample weights summed over the ranks (a
        rank with only a stand-in row adds 0), for ``replica_loss``."""
        def sum_weights(w):
            return collectives.sum_tensors([w * (1.0 if n_real else 0.0)],
                                           self.strategy.device)[0]

        return sum_weights

    def track_loss(self, replica, x, y, y_pred, sample_weight, training, n_real, n_global):
        """Update the loss tracker with this rank's value (``replica_loss``, the rule of
        ``kmgpu.engines.loss_fixes``); returns the rank's part of the global loss (0
        for a stand-in row)."""
        from kmgpu.engines import loss_fixes as common

        kind, local, part = common.replica_loss(
            replica, x, y, y_pred, sample_weight, training, n_real, max(n_global, 1),
            self.sum_weights(n_real))
        if not n_real:
            return part * 0.0
        value, weight = common.tracker_update(kind, local, part, n_real, n_global)
        replica._loss_tracker.update_state(value, sample_weight=weight)
        return part

    @contextlib.contextmanager
    def summed_metrics(self, replica):
        """Within the block the metric variables hold their sums over ranks (when a
        distributed call is running; yields whether they do)."""
        if not self.strategy.collective:
            yield False
            return
        seen, variables = set(), []
        for m in replica.metrics:
            for v in m.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    variables.append(v)
        local = [v.value.detach().clone() for v in variables]
        try:
            with torch.no_grad():
                sums = collectives.sum_tensors([v.value for v in variables],
                                               self.strategy.device)
                for v, s in zip(variables, sums):
                    v.value.copy_(s)
            yield True
        finally:
            with torch.no_grad():
                for v, s in zip(variables, local):
                    v.value.copy_(s)

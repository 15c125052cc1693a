"""The steps one torch rank's replica runs: Keras's train step through
DistributedDataParallel, kmgpu's split (captured) step, a model's own step, the test
step, and how a rank's loss and metrics join the other ranks'.

``RankSteps`` is the half of ``strategy.DDPStrategy`` that builds these steps; the
strategy itself prepares a replica and runs one call (see ``strategy``'s docstring for
how one global batch becomes N equal steps).
"""

import contextlib

import keras
import torch
import torch.distributed as dist

from kmgpu.engines.torch import collectives
from kmgpu.engines.torch.data import inputs
from kmgpu.engines.torch.steps import global_batch, own_steps


class RankSteps:
    """The step builders of ``DDPStrategy``; they read its ``rank``, ``world``,
    ``device``, ``train``/``test`` slices and its ``config``'s ``sync_batchnorm``,
    ``shard_optimizer`` and ``tf32``."""

    def _average_statistics(self, variables, share):
        """Non-sync BatchNorm: moving statistics averaged over ranks, weighted by share."""
        if not variables or self.world == 1:
            return
        with torch.no_grad():
            sums = collectives.sum_tensors([v.value * share for v in variables], self.device)
            for v, s in zip(variables, sums):
                v.value.copy_(s)

    def _train_step(self, replica, ddp, averaged):
        def train_step(batch):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            if self.train is None:
                raise RuntimeError(
                    "kmgpu: this replica trains only inside a distributed fit (a callback "
                    "on rank 0 cannot call fit on it)."
                )
            n_real, n_global = self.train.current
            self.n_real, self.in_train_step = n_real, True
            try:
                with global_batch.on_global(self.rank, self.world, (n_real, n_global)):
                    if replica._call_has_training_arg:
                        y_pred = ddp(x, training=True)
                    else:
                        y_pred = ddp(x)
            finally:
                self.in_train_step = False
            replica.zero_grad()
            part = self._track_loss(replica, x, y, y_pred, sample_weight, True, n_real, n_global)
            share = n_real / n_global
            loss = replica.optimizer.scale_loss(part)
            trainable = replica.trainable_weights[:]
            loss.backward()  # DDP sums the weighted gradients over ranks
            gradients = [v.value.grad for v in trainable]
            with torch.no_grad():
                replica.optimizer.apply(gradients, trainable)
            self._average_statistics(averaged, share)
            if n_real:
                return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return replica.get_metrics_result()

        return train_step

    def _captured_step(self, replica, averaged):
        """The split step of ``graphs`` (the default on GPUs, jit_compile=True on a CPU),
        captured as CUDA graphs on a GPU, eager on a CPU; its one collective is the flat
        gradient all-reduce."""
        from kmgpu.engines.torch.capture import graphs

        def rows(x):
            if self.train is None:
                raise RuntimeError(
                    "kmgpu: this replica trains only inside a distributed fit (a callback "
                    "on rank 0 cannot call fit on it).")
            return self.train.current

        @contextlib.contextmanager
        def forward(n_real):
            self.n_real, self.in_train_step = n_real, True
            try:
                with global_batch.on_global(self.rank, self.world, self.train.current):
                    yield
            finally:
                self.in_train_step = False

        def reduce(flats):
            for flat in flats:
                dist.all_reduce(flat)

        shard = self.config.shard_optimizer and self.world > 1
        split = graphs.SplitStep(replica, world=self.world, reduce=reduce if self.world > 1
                                 else None, averaged=averaged, rows=rows, forward=forward,
                                 rank=self.rank, shard=shard)
        self.sharded = split if shard else None
        refuse = None
        if self.config.sync_batchnorm and self.world > 1 and graphs.available(self.device):
            refuse = "sync_batchnorm all-reduces inside the forward pass"
        elif replica.run_eagerly:  # the split step for ZeRO-1 or added losses only: eager
            refuse = "compile(run_eagerly=True)"
        return graphs.CapturedStep(split, self.device, say=print if self.rank == 0 else None,
                                   refuse=refuse, tf32=self.config.tf32)

    def _hook_optimizer(self, replica, averaged):
        """A model with its own ``train_step``: gradients summed in ``optimizer.apply``
        weighted by this rank's rows, its loss tracker likewise (``own_steps``)."""
        own_steps.OwnSteps(self).prepare(replica, averaged)

    def _test_step(self, replica):
        def test_step(batch):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            rows = self.test.current if self.test is not None else None
            n_real, n_global = rows or (inputs.num_rows(x),) * 2
            with global_batch.on_global(self.rank, self.world, rows, training=False):
                if replica._call_has_training_arg:
                    y_pred = replica(x, training=False)
                else:
                    y_pred = replica(x)
            self._track_loss(replica, x, y, y_pred, sample_weight, False, n_real, n_global)
            if not n_real:
                return replica.get_metrics_result()
            return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        return test_step

    def sum_weights(self, n_real):
        """``sum_weights(w)``: a rank's sum of sample weights summed over the ranks (a
        rank with only a stand-in row adds 0), for ``replica_loss``."""
        def sum_weights(w):
            return collectives.sum_tensors([w * (1.0 if n_real else 0.0)], self.device)[0]

        return sum_weights

    def _track_loss(self, replica, x, y, y_pred, sample_weight, training, n_real, n_global):
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
    def _summed_metrics(self, replica):
        """Within the block the metric variables hold their sums over ranks (when a
        distributed call is running; yields whether they do)."""
        if not self.collective:
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
                sums = collectives.sum_tensors([v.value for v in variables], self.device)
                for v, s in zip(variables, sums):
                    v.value.copy_(s)
            yield True
        finally:
            with torch.no_grad():
                for v, s in zip(variables, local):
                    v.value.copy_(s)

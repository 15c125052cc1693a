"""The global batch as one torch rank's step reaches it (``global_losses.Batch``): the
rank's rows are rows ``inputs.split(n_global, world, rank)`` of the global batch (a rank
without rows holds one stand-in row, weight 0, and adds none)."""

import contextlib

import torch

from kmgpu.engines import global_losses
from kmgpu.engines.torch import collectives
from kmgpu.engines.torch.data import inputs


class RankBatch(global_losses.Batch):
    """Args: rank, world: this rank and the group's size; n_real, n_global: the real
    rows of this rank's batch and the rows of the global batch; weight: the weight
    this rank's gradients get after the backward pass (``own_steps``: its share; None:
    none, the rank's loss is weighed instead); refuse, training: as
    ``global_losses.Batch``'s."""

    def __init__(self, rank, world, n_real, n_global, weight=None, refuse=None,
                 training=True):
        self.weight, self.refuse, self.training = weight, refuse, training
        self.lo, self.hi = inputs.split(n_global, world, rank)
        self.n_real, self.n_global = n_real, n_global
        self.local = n_real if n_real else 1  # the stand-in row

    def is_local(self, t):
        return t.shape[0] == self.local

    def is_global(self, t):
        return t.shape[0] == self.n_global

    def gather(self, t):
        """Each rank places its rows in a zero tensor of the global batch's rows; their
        sum over ranks (``SumOverRanks``: the gradient summed likewise, then this rank's
        rows taken) is the global batch. One all-reduce; exact, as every row is 0 on
        all ranks but one.

        With ``weight`` w_r (a rank's gradients weighed after the backward pass), each
        rank's gradient of the global tensor is multiplied by its w_k before the sum and
        this rank's rows' by 1 / w_r after it: the gradient of a loss every rank adds
        whole then counts once (sum_k w_k = 1), and that of this rank's own outputs
        (only its own gradient is non-zero there) stays as it was."""
        rows = t[:self.n_real]
        weighed = self.weight is not None and t.requires_grad
        if weighed:
            rows = _ScaleGrad.apply(rows, 1.0 / self.weight if self.weight else 0.0)
        shape = (self.n_global,) + tuple(t.shape[1:])
        if self.n_real == self.n_global:
            full = rows
        else:
            full = torch.cat([rows.new_zeros((self.lo,) + shape[1:]), rows,
                              rows.new_zeros((self.n_global - self.hi,) + shape[1:])])
        if full.is_floating_point() or full.is_complex():
            full = collectives.SumOverRanks.apply(full)
            return _ScaleGrad.apply(full, float(self.weight)) if weighed else full
        return collectives.sum_tensors([full], full.device)[0]

    def mine(self, t):
        return t[self.lo:self.hi] if self.n_real else t[:1]


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def on_global(rank, world, rows, **options):
    """``global_losses.on_global`` for a rank's step of ``rows`` (n_real, n_global), with
    ``RankBatch``'s ``options``; nothing for one rank or outside a distributed call
    (``rows`` None)."""
    if world == 1 or rows is None or not rows[1]:
        return contextlib.nullcontext()
    return global_losses.on_global(RankBatch(rank, world, *rows, **options))

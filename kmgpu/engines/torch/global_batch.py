"""The global batch as one torch rank's step reaches it (``global_losses.Batch``): the
rank's rows are rows ``data.split(n_global, world, rank)`` of the global batch (a rank
without rows holds one stand-in row, weight 0, and adds none)."""

import contextlib

import torch

from kmgpu.engines import global_losses
from kmgpu.engines.torch import collectives, data


class RankBatch(global_losses.Batch):
    """Args: rank, world: this rank and the group's size; n_real, n_global: the real
    rows of this rank's batch and the rows of the global batch."""

    def __init__(self, rank, world, n_real, n_global):
        self.lo, self.hi = data.split(n_global, world, rank)
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
        all ranks but one."""
        rows = t[:self.n_real]
        shape = (self.n_global,) + tuple(t.shape[1:])
        if self.n_real == self.n_global:
            full = rows
        else:
            full = torch.cat([rows.new_zeros((self.lo,) + shape[1:]), rows,
                              rows.new_zeros((self.n_global - self.hi,) + shape[1:])])
        if full.is_floating_point() or full.is_complex():
            return collectives.SumOverRanks.apply(full)
        return collectives.sum_tensors([full], full.device)[0]

    def mine(self, t):
        return t[self.lo:self.hi] if self.n_real else t[:1]


def on_global(rank, world, rows):
    """``global_losses.on_global`` for a rank's step of ``rows`` (n_real, n_global);
    nothing for one rank or outside a distributed call (``rows`` None)."""
    if world == 1 or rows is None or not rows[1]:
        return contextlib.nullcontext()
    return global_losses.on_global(RankBatch(rank, world, *rows))

"""shard="weights" on torch: a rank's pieces to and from the whole arrays held elsewhere.

A pool's state file holds each variable's whole value (``transport.StateFile``), mapped
by every rank. A rank reads only the elements its pieces hold (``take``: a call's state
in) and writes only those (``give``: a snapshot out); the N ranks' pieces together cover
every element once, so no rank reads, copies or gathers the whole state.

The pieces are ``zero.Shards``' (``flat_optim.Piece``: the weights and each optimizer
slot of this rank's part of each layer buffer); ``array_of(variable)`` /
``view_of(variable)`` give a variable's whole value as a host tensor (a view of the
file), or None where there is none.
"""

import torch


def _pairs(zero):
    """(buffer index, piece, this rank's tensor, the Keras variables laid out in it) for
    the weights and every optimizer slot."""
    for k, piece in enumerate(zero.flat.pieces):
        yield k, piece, piece.params, zero.flat.variables
        for name, own in piece.slots.items():
            yield k, piece, own, zero.flat.keras_slots[name]


@torch.no_grad()
def take(zero, array_of):
    """This rank's pieces from the variables' whole values (None: zeros); the whole
    weights and the Keras slot variables are left holding no memory."""
    zero.free_weights()
    weights = zero.flat.weights
    for k, piece, own, variables in _pairs(zero):
        own.zero_()  # the padding between the tensors stays 0
        for i, a, b in weights.overlaps(k, piece.lo, piece.hi):
            src = array_of(variables[i])
            if src is not None:
                o = weights.start[i]
                own[a - piece.lo:b - piece.lo].copy_(src.reshape(-1)[a - o:b - o])
    zero.drop_slots()


@torch.no_grad()
def give(zero, view_of):
    """This rank's pieces into the variables' whole arrays (None: not wanted): only
    the elements the pieces hold are written."""
    weights = zero.flat.weights
    for k, piece, own, variables in _pairs(zero):
        for i, a, b in weights.overlaps(k, piece.lo, piece.hi):
            dest = view_of(variables[i])
            if dest is not None:
                o = weights.start[i]
                dest.reshape(-1)[a - o:b - o].copy_(own[a - piece.lo:b - piece.lo])


def versions(zero):
    """Each piece's tensor with its ``_version`` (what tells a later step or load)."""
    return [(own, own._version) for _, _, own, _ in _pairs(zero)]

"""shard="weights" on torch: a rank's pieces to and from the whole arrays held elsewhere.

A rank reads only the elements its pieces hold (``take``, ``fill``: a call's state in)
and writes only those (``spans``: a snapshot out, ``replicas.pieces_out``); the N ranks'
pieces together cover every element once, so no rank reads, copies or gathers the whole
state. The whole values are a checkpoint's file mapped by every rank (``take``,
``replicas.write_pieces``), or your model's variables in the driver, which sends and
receives each rank's spans over its pipe (``launch.state_pipe``: ``fill``, ``spans``).

The pieces are ``zero.Shards``' (``flat_optim.Piece``: the weights and each optimizer
slot of this rank's part of each layer buffer); ``array_of(variable)`` gives a
variable's whole value as a host tensor (a view of the file), or None where there is
none.
"""

import torch


def _pairs(zero):
    """(buffer index, piece, this rank's tensor, the Keras variables laid out in it) for
    the weights and every optimizer slot."""
    for k, piece in enumerate(zero.flat.pieces):
        yield k, piece, piece.params, zero.flat.variables
        for name, own in piece.slots.items():
            yield k, piece, own, zero.flat.keras_slots[name]


def spans(zero):
    """(Keras variable, start, stop, this rank's tensor) for every run of elements
    ``[start, stop)`` of a variable's flattened whole value that one of this rank's
    pieces holds (the weights and every optimizer slot); the N ranks' spans cover
    every element once."""
    weights = zero.flat.weights
    for k, piece, own, variables in _pairs(zero):
        for i, a, b in weights.overlaps(k, piece.lo, piece.hi):
            o = weights.start[i]
            yield variables[i], a - o, b - o, own[a - piece.lo:b - piece.lo]


@torch.no_grad()
def fill(zero, copy):
    """This rank's pieces from elsewhere: ``copy(spans)`` fills the tensor of each span
    (``spans``; what it leaves is zero, as is the padding between the tensors); the
    whole weights and the Keras slot variables are left holding no memory."""
    zero.free_weights()
    for _, _, own, _ in _pairs(zero):
        own.zero_()
    copy(list(spans(zero)))
    zero.drop_slots()


def take(zero, array_of):
    """This rank's pieces from the variables' whole values, ``array_of(variable)``: a
    host tensor, or None (zeros)."""

    def copy(found):
        for v, lo, hi, own in found:
            src = array_of(v)
            if src is not None:
                own.copy_(src.reshape(-1)[lo:hi])

    fill(zero, copy)


def versions(zero):
    """Each piece's tensor with its ``_version`` (what tells a later step or load)."""
    return [(own, own._version) for _, _, own, _ in _pairs(zero)]

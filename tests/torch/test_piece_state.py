"""shard="weights": a rank reads and writes only its own pieces of a state held whole
elsewhere (a checkpoint's file), measured in bytes.

In one process, four ``zero.Shards`` (ranks 0..3 of 4, no collective runs) of one model
each take their pieces from the same whole arrays (``piece_state.take``, as a call's
state comes in) and write them back into other whole arrays by ``piece_state.spans``
(as a snapshot goes out). A ``TorchDispatchMode`` counts the bytes every operation reads from
the source arrays and writes into the target arrays, and the largest tensor it makes:
each rank reads and writes its 1/N (padding aside), together the four cover every
element exactly once, and no operation makes anything as large as a layer's state.
"""

import keras
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kmgpu.engines.torch.optim import piece_state, zero

N = 4


def _model():
    keras.utils.set_random_seed(6)
    return keras.Sequential([keras.Input((64,))] +
                            [keras.layers.Dense(64, activation="tanh") for _ in range(3)] +
                            [keras.layers.Dense(64)])


def _shards(rank):
    model = _model()
    shards = zero.Shards(keras.optimizers.Adam(0.01), model.trainable_weights, rank, N,
                         transient=True, weights=True)
    keys = {id(v): ("weights", i) for i, v in enumerate(shards.flat.variables)}
    for name, slots in shards.flat.keras_slots.items():
        keys.update({id(v): (name, i) for i, v in enumerate(slots)})
    return shards, keys


class _Meter(TorchDispatchMode):
    """Bytes read from ``sources``' storages and written into ``targets``' by every
    operation that is not a view, and the largest tensor an operation made."""

    def __init__(self, sources=(), targets=()):
        super().__init__()
        self.sources = {t.untyped_storage().data_ptr() for t in sources}
        self.targets = {t.untyped_storage().data_ptr() for t in targets}
        self.read = self.written = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ptrs = {a.untyped_storage().data_ptr() for a in tensors}
        for i, a in enumerate(tensors):
            ptr = a.untyped_storage().data_ptr()
            nbytes = a.numel() * a.element_size()
            if ptr in self.sources:
                self.read += nbytes
            if ptr in self.targets and i == 0:  # an in-place op's destination
                self.written += nbytes
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ptrs:
                self.largest = max(self.largest, o.untyped_storage().nbytes())
        return out


def test_each_rank_reads_and_writes_only_its_pieces():
    rng = np.random.default_rng(0)
    shards, keys = _shards(0)
    every = list(shards.flat.variables) + [v for s in shards.flat.keras_slots.values() for v in s]
    source = {keys[id(v)]: rng.normal(size=tuple(v.shape)).astype("float32") for v in every}
    target = {k: np.zeros_like(a) for k, a in source.items()}
    total = sum(a.nbytes for a in source.values())
    layer = max(f.numel() for f in shards.flat.params) * 4  # one layer's weights, bytes
    src = {k: torch.from_numpy(a) for k, a in source.items()}
    dst = {k: torch.from_numpy(a) for k, a in target.items()}
    read = written = 0
    for rank in range(N):
        shards, keys = _shards(rank) if rank else (shards, keys)
        with _Meter(sources=src.values()) as meter:
            piece_state.take(shards, lambda v: src[keys[id(v)]])
        assert meter.read <= total / N * 1.1, (rank, meter.read, total)
        assert meter.largest < layer / N * 1.1  # nothing whole made: at most a piece
        read += meter.read
        # the pieces hold exactly their elements of the state
        weights = shards.flat.weights
        for k, piece in enumerate(shards.flat.pieces):
            for name, own in [("weights", piece.params)] + list(piece.slots.items()):
                for i, a, b in weights.overlaps(k, piece.lo, piece.hi):
                    o = weights.start[i]
                    np.testing.assert_array_equal(own[a - piece.lo:b - piece.lo].numpy(),
                                                  source[(name, i)].reshape(-1)[a - o:b - o])
        with _Meter(targets=dst.values()) as meter:
            for v, lo, hi, own in piece_state.spans(shards):  # as a snapshot writes them
                dst[keys[id(v)]].reshape(-1)[lo:hi].copy_(own)
        assert meter.written <= total / N * 1.1, (rank, meter.written, total)
        assert meter.largest < layer / N * 1.1
        written += meter.written
    assert read == written == total  # the ranks' pieces: every element once
    for k in source:
        np.testing.assert_array_equal(target[k], source[k])

"""shard="weights" on torch (ZeRO-3 / FSDP): each rank keeps 1/N of the weights too; a
layer's weights are gathered when they are used, forward and backward, and freed after.

``zero.Shards`` (with ``weights``) lays the trainable variables out in one flat buffer
per layer and dtype (``flat_layout.Buffers`` with groups), each padded to N equal pieces;
rank r keeps piece r of each as a tensor of its own (the flat optimizer updates it) and
the whole buffers' memory is freed (``untyped_storage().resize_(0)``: the variables'
torch Parameters stay views of them, so Keras, autograd and the optimizer see the same
objects throughout).

``Gathering`` makes a layer's weights whole where the step uses them, without a hook in
Keras's layer call (Keras 3 calls ``Layer.call`` itself, never ``nn.Module.__call__``, so
torch's module hooks do not fire):

- forward: a ``TorchFunctionMode`` looks at the tensors every torch function gets; one
  whose storage is a freed layer buffer has that buffer all-gathered first (its memory
  grown back, the N pieces gathered into it, in place);
- backward: ``saved_tensors_hooks``: autograd keeps the weight tensor it saved (a view of
  the buffer, holding no memory once freed), and unpacking it for backward gathers that
  buffer again first;
- at most ``KEEP`` buffers are whole at a time: gathering one more frees the least
  recently used (a layer used again is gathered again), and the step's end frees all.

Every rank runs the same layers in the same order, so every rank gathers the same buffer
at the same point: the all-gathers match. A rank with only a stand-in row runs the
same forward. Memory: 1/N of the weights, gradient pieces and optimizer state between
steps; within a step the ``KEEP`` gathered buffers, the activations and (as with
shard="gradients") the step's whole gradient buffers, freed once reduce-scattered.

The replica is built in host memory (``placement``): the flat buffers are made on the
device one at a time and freed at once (``flat_layout.Buffers.move_freed``), so a
device only ever holds this rank's pieces and the gathered layers.

On CUDA the train step is captured as it is unsharded: the forward and backward, with
their gathers, are graph A, so the all-gathers (NCCL) and the buffers' memory (grown from
the graph's pool during the capture, at the addresses each replay uses) are recorded in
it; the reduce-scatter stays outside, between A and the update (graph B).
"""

import collections
import contextlib

import torch
from torch.overrides import TorchFunctionMode

#: layer buffers whole at a time within a step (the one in use and the one before it)
KEEP = 2

#: host memory: where a rank builds its replica and loads a call's state (``zero.Shards``
#: ``receivable`` / ``take``), so that its device only ever holds pieces and gathered layers
HOST = torch.device("cpu")


def _all_gather(out, piece):
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, piece)


def storage_key(t):
    """The identity of ``t``'s storage (the same for every view of one buffer, whether
    its memory is held or freed)."""
    return t.untyped_storage()._cdata


def free(flat):
    """Free ``flat``'s memory; its views stay valid objects (``grow`` gives it back)."""
    flat.untyped_storage().resize_(0)


def grow(flat):
    """Give ``flat`` its memory back (contents undefined)."""
    st = flat.untyped_storage()
    need = flat.numel() * flat.element_size()
    if st.nbytes() != need:
        st.resize_(need)


def is_free(flat):
    return flat.untyped_storage().nbytes() == 0


class Gathering:
    """This rank's whole layer buffers, gathered from the pieces when used (see the
    module).

    Args:
        flats: the whole flat weight buffers (one per layer and dtype), freed.
        pieces: this rank's piece of each (tensors of their own).
        gather: ``gather(flat, piece)`` all-gathers the pieces into ``flat`` (None: the
            collective; tests pass their own).
    """

    def __init__(self, flats, pieces, gather=None):
        self.flats, self.pieces = list(flats), list(pieces)
        self.gather = gather or _all_gather
        self.index = {storage_key(f): k for k, f in enumerate(self.flats)}
        self.whole = collections.OrderedDict()  # gathered buffers, least recent first
        self.gathers = 0  # how many all-gathers ran (for tests)

    def ensure(self, k):
        """Buffer ``k`` whole (gathered now unless it is already)."""
        if k in self.whole:
            self.whole.move_to_end(k)
            return
        while len(self.whole) >= KEEP:
            self.release(next(iter(self.whole)))
        flat = self.flats[k]
        grow(flat)
        with torch.no_grad():
            self.gather(flat, self.pieces[k])
        self.whole[k] = True
        self.gathers += 1

    def release(self, k):
        """Free buffer ``k``."""
        self.whole.pop(k, None)
        free(self.flats[k])

    def release_all(self):
        for k in list(self.whole):
            self.release(k)

    def touch(self, tensors):
        """Gather the buffers of any of ``tensors`` that are views of one."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                k = self.index.get(storage_key(t))
                if k is not None:
                    self.ensure(k)

    @contextlib.contextmanager
    def active(self):
        """Within the block the weights are gathered where used (forward and backward);
        at its end every gathered buffer is freed."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            with _Mode(self), hooks:
                yield
        finally:
            self.release_all()

    def _pack(self, t):
        k = self.index.get(storage_key(t))
        return t if k is None else (k, t)

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            k, t = packed
            self.ensure(k)
            return t
        return packed


class _Mode(TorchFunctionMode):
    """Gathers a freed layer buffer before a torch function reads a view of it."""

    def __init__(self, gathering):
        super().__init__()
        self.gathering = gathering

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":  # metadata reads need no data
            self.gathering.touch(args)
            self.gathering.touch(kwargs.values())
            for a in args:
                if isinstance(a, (list, tuple)):
                    self.gathering.touch(a)
        return func(*args, **kwargs)

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
  grown back, the N pieces gathered into it, in place). A Keras variable can reach a
  torch function as itself, not as a tensor: ``x @ self.w``, ``x + self.b`` (a tensor's
  operator with the variable on its right) and ``torch.matmul(x, self.w)`` hand the mode
  the variable, since it has a ``__torch_function__`` of its own, which replaces it by
  its value only after the mode let the call through; so the mode knows each variable's
  buffer too (``Gathering``'s ``variables``), without reading its value (under a mixed
  precision autocast scope that value is a cast, an operation on the freed memory);
- backward: ``saved_tensors_hooks``: autograd keeps the weight tensor it saved (a view of
  the buffer, holding no memory once freed), and unpacking it for backward gathers that
  buffer again first;
- at most ``KEEP`` buffers are whole at a time: gathering one more frees the least
  recently used (a layer used again is gathered again), and the step's end frees all.

Besides the steps, Keras's symbolic build at the start of fit, evaluate and the
``*_on_batch`` calls runs the model (until the compiled metrics are built): the replica
runs it within ``Gathering`` too (``DDPStrategy``, ``step_fixes.build_within``), as a
float16 cast of a weight under mixed_float16 reads its buffer even there.

``Scattering`` hands each layer's gradient on as soon as the backward pass has made it
(``zero.Shards.scattered``): a hook on each variable's torch Parameter keeps its
gradient until its layer buffer's are all there, then they are copied into a flat
buffer as long as that layer's, which is reduce-scattered into this rank's gradient
piece (``zero.Shards.grad_pieces``, what the update reads); the gradients are let go at
once (the hook hands autograd a stand-in of no memory), and the next layer reuses the
buffer's memory (one scratch buffer per dtype, let go at the backward pass's end).
Buffers with a variable that got no gradient go at the backward pass's end, in buffer
order, zeros for it (the update then refuses the step). Where the gradient is all-reduced
whole (clipnorm / global_clipnorm / a LossScaleOptimizer: the norms and the finite check
need every element) the step's whole gradient buffers are made and all-reduced after the
backward pass instead, as with shard="gradients".

Every rank runs the same layers in the same order, so every rank gathers the same buffer
at the same point: the all-gathers match; autograd runs the same graph's nodes in the
same order on every rank, so the reduce-scatters match too. A rank with only a stand-in
row runs the same forward and backward (its loss times 0). Memory: 1/N of the weights,
gradient pieces and optimizer state between steps; within a step the ``KEEP`` gathered
buffers, the activations and one layer's gradient (for the moment of its copy twice:
autograd's and its flat buffer), never the whole model's.

The replica is built in host memory (``placement``): the flat buffers are made on the
device one at a time and freed at once (``flat_layout.Buffers.move_freed``), so a
device only ever holds this rank's pieces and the gathered layers.

On CUDA the train step is captured as it is unsharded: the forward and backward, with
their gathers and the layers' reduce-scatters, are graph A, so the all-gathers and
reduce-scatters (NCCL) and the buffers' memory (weights grown and layer gradient buffers
made from the graph's pool during the capture, at the addresses each replay uses) are
recorded in it; the pieces it writes are made once, before, where the update (graph B)
reads them. Between A and B only the BatchNorm statistics' all-reduce stays (and the
whole gradient's, where it is all-reduced whole).
"""

import collections
import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

#: layer buffers whole at a time within a step (the one in use and the one before it)
KEEP = 2

#: host memory: where a rank builds its replica and loads a call's state (``zero.Shards``
#: ``receivable`` / ``take``), so that its device only ever holds pieces and gathered layers
HOST = torch.device("cpu")


def all_gather(out, piece):
    """Every rank's ``piece`` into ``out`` (in place), whichever name this torch has."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, piece)


def reduce_scatter(out, flat):
    """The sum over ranks of this rank's piece of ``flat`` into ``out``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat)


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


def to_host(own, numel, rank, world):
    """Every rank's piece ``own`` into a host tensor of ``numel`` elements on rank 0
    (None elsewhere), one piece at a time (point to point: NCCL and gloo both)."""
    import torch.distributed as dist

    if rank != 0:
        dist.send(own, dst=0)
        return None
    whole = torch.empty(numel, dtype=own.dtype, device=HOST)
    n = own.numel()
    whole[:n].copy_(own)
    staging = torch.empty_like(own) if world > 1 else None
    for src in range(1, world):
        dist.recv(staging, src=src)
        whole[src * n:(src + 1) * n].copy_(staging)
    return whole


def from_rank0(own, whole, rank, world):
    """Rank 0's host buffer ``whole``, piece by piece: piece r into rank r's ``own``."""
    import torch.distributed as dist

    if rank != 0:
        dist.recv(own, src=0)
        return
    n = own.numel()
    own.copy_(whole[:n])
    staging = torch.empty_like(own) if world > 1 else None
    for dst in range(1, world):
        staging.copy_(whole[dst * n:(dst + 1) * n])
        dist.send(staging, dst=dst)


class Gathering:
    """This rank's whole layer buffers, gathered from the pieces when used (see the
    module).

    Args:
        flats: the whole flat weight buffers (one per layer and dtype), freed.
        pieces: this rank's piece of each (tensors of their own).
        gather: ``gather(flat, piece)`` all-gathers the pieces into ``flat`` (None: the
            collective; tests pass their own).
        variables: the Keras variables whose values are views of ``flats`` (read here,
            outside any scope: the torch Parameters themselves); a torch function handed
            one of them as it is gathers its buffer as for its value.
    """

    def __init__(self, flats, pieces, gather=None, variables=()):
        self.flats, self.pieces = list(flats), list(pieces)
        self.gather = gather or all_gather
        self.index = {storage_key(f): k for k, f in enumerate(self.flats)}
        self.variables = list(variables)  # held: ``owner`` is keyed by their ids
        self.owner = {}  # id(Keras variable): its buffer
        for v in self.variables:
            k = self.index.get(storage_key(v.value))
            if k is not None:
                self.owner[id(v)] = k
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

    def touch(self, objects):
        """Gather the buffers of any of ``objects`` that are views of one, or Keras
        variables whose values are."""
        for t in objects:
            if isinstance(t, torch.Tensor):
                k = self.index.get(storage_key(t))
            else:
                k = self.owner.get(id(t))
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


class Scattering:
    """This rank's gradient pieces, reduce-scattered one layer at a time as the backward
    pass produces each layer's gradients (see the module).

    A hook on each variable's torch Parameter (a leaf: its hook runs when its gradient
    is complete, before ``torch.autograd.grad`` takes it) keeps the gradient until
    every variable of its layer buffer has one; then the layer's flat gradient buffer
    is made (zeros: the padding), the gradients copied into it and let go, and it is
    reduce-scattered into this rank's piece. Each hook returns a stand-in that holds no
    memory (a zero expanded to the gradient's shape), so autograd keeps none of the
    gradients either. The layer buffers are the front of one scratch buffer per dtype,
    as long as the largest layer's, made at the first layer that needs it and let go at
    the backward pass's end: within a CUDA graph capture the caching allocator does not
    reuse memory a collective's stream used until the capture ends, so a new buffer per
    layer would leave every layer's in the graph's pool; the next layer's copy waits for
    the reduce-scatter on the stream (a collective without ``async_op`` makes the
    current stream wait for it).

    Args:
        layout: the flat weights' ``flat_layout.Buffers`` (one buffer per layer and
            dtype).
        out: this rank's gradient piece of each buffer (written, in place).
        scatter: ``scatter(piece, flat)`` reduce-scatters ``flat`` into ``piece`` (None:
            the collective; tests pass their own).
    """

    def __init__(self, layout, out, scatter=None):
        self.layout, self.out = layout, list(out)
        self.scatter = scatter or reduce_scatter
        self.group = {i: k for k, members in enumerate(layout.members) for i in members}
        self.pending = None  # within ``active``: per buffer, {variable index: gradient}
        self.sent = None  # within ``active``: per buffer, reduce-scattered yet
        self.scratch = None  # within ``active``: {dtype: the layer buffers' memory}
        self.scatters = 0  # how many reduce-scatters ran (for tests)

    @contextlib.contextmanager
    def active(self, params):
        """Within the block a backward pass reduce-scatters each layer's gradient as soon
        as it is complete (``params``: the variables' torch Parameters, the layout's
        order, the tensors the backward pass differentiates for); at the block's end (no error) the buffers with a variable
        that got no gradient are reduce-scattered too (zeros for it), in buffer order:
        every rank runs the same graph, so every rank sends the same buffers in the same
        order."""
        self.pending = [{} for _ in self.layout.members]
        self.sent = [False] * len(self.layout.members)
        self.scratch = {}
        handles = [p.register_hook(functools.partial(self._arrived, i))
                   for i, p in enumerate(params)]
        try:
            yield
            for k, sent in enumerate(self.sent):
                if not sent:
                    self._send(k)
        finally:
            for h in handles:
                h.remove()
            self.pending = self.sent = self.scratch = None

    def _arrived(self, i, grad):
        k = self.group[i]
        self.pending[k][i] = grad
        if len(self.pending[k]) == len(self.layout.members[k]):
            self._send(k)
        return grad.new_zeros(()).expand(grad.shape)  # what autograd keeps: no memory

    @torch.no_grad()
    def _send(self, k):
        """Buffer ``k``'s gradients into a flat buffer as long as it (``_buffer``),
        reduce-scattered into this rank's piece; the gradients let go."""
        got, piece = self.pending[k], self.out[k]
        flat = self._buffer(piece, self.layout.flats[k].numel())
        for i, view in zip(self.layout.members[k], self.layout.split(k, flat)):
            grad = got.pop(i, None)
            if grad is not None:
                view.copy_(grad)
            del grad
        self.scatter(piece, flat)
        self.sent[k] = True
        self.scatters += 1

    def _buffer(self, piece, numel):
        """A zeroed buffer of ``numel`` elements of ``piece``'s dtype, on its device: the
        front of the scratch buffer (made anew, the old one let go first, when it is
        shorter)."""
        scratch = self.scratch.get(piece.dtype)
        if scratch is None or scratch.numel() < numel:
            self.scratch.pop(piece.dtype, None)
            del scratch
            scratch = self.scratch[piece.dtype] = piece.new_empty(numel)
        flat = scratch[:numel]
        flat.zero_()
        return flat


class _Mode(TorchFunctionMode):
    """Gathers a freed layer buffer before a torch function reads a view of it, or a
    Keras variable whose value is one (the variable's own ``__torch_function__`` reads
    that value after this mode's)."""

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

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
- prefetch: from a block's second run on (a train step, a test or predict step, the
  symbolic build: each ``key`` its own), gathering a buffer starts the all-gather of the
  one the last run gathered next, without waiting (on NCCL it runs on the collectives'
  stream beside the layer's compute), and the wait comes where that buffer is used;
- at most ``KEEP`` buffers in use and ``PREFETCH`` started ahead (``HOST_PREFETCH`` on a
  CPU device) are whole at a time: using one more frees the least recently used (a
  layer used again is gathered again), and the step's end frees all.

Besides the steps, Keras's symbolic build at the start of fit, evaluate and the
``*_on_batch`` calls runs the model (until the compiled metrics are built): the replica
runs it within ``Gathering`` too (``DDPStrategy``, ``step_fixes.build_within``), as a
float16 cast of a weight under mixed_float16 reads its buffer even there.

``scattering.Scattering`` reduce-scatters each layer's gradient as soon as the backward
pass has made it, the reduce-scatter running while the backward pass goes on.

Every rank runs the same layers in the same order, so every rank gathers the same buffer
at the same point, and prefetches the same ones: the all-gathers match. A rank with only
a stand-in row runs the same forward and backward (its loss times 0). Memory: 1/N of the
weights, gradient pieces and optimizer state between steps; within a step the
``KEEP + PREFETCH`` whole buffers, the activations and, of the gradient, two layers'
buffers (one being reduce-scattered while the next is filled) and autograd's gradient of
the layer being copied; never the whole model's. On a CPU device, where all of that is
host memory, one whole buffer and one gradient buffer fewer (``HOST_PREFETCH``,
``scattering.Scattering.HOST_SLOTS``), and each worker has glibc map its large blocks on
their own (``heap.map_large_blocks``) so that a freed layer's memory goes back at once.

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

import torch
from torch.overrides import TorchFunctionMode

#: layer buffers whole at a time within a step (the one in use and the one before it)
KEEP = 2

#: layer buffers gathered ahead of their use besides (``Gathering``'s prefetch)
PREFETCH = 1

#: the same on a CPU device, whose buffers are host memory and whose all-gathers (gloo)
#: run on the step's own cores: nothing to overlap, one whole layer more held
HOST_PREFETCH = 0

#: host memory: where a rank builds its replica and loads a call's state (``zero.Shards``
#: ``receivable`` / ``take``), so that its device only ever holds pieces and gathered layers
HOST = torch.device("cpu")


def all_gather(out, piece, async_op=False):
    """Every rank's ``piece`` into ``out`` (in place), whichever name this torch has;
    with ``async_op``, returns the handle to ``wait()`` on before reading ``out``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, piece, async_op=async_op)


def reduce_scatter(out, flat, async_op=False):
    """The sum over ranks of this rank's piece of ``flat`` into ``out``; with
    ``async_op``, returns the handle to ``wait()`` on before reading ``out`` or writing
    ``flat``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, flat, async_op=async_op)


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

    Prefetch: a block (``active(key)``) records the order its buffers were gathered in,
    per ``key`` (a train step's forward and backward, a test step, a predict step, the
    symbolic build); the next block of that key, on gathering one, starts the
    all-gather of the one that came next last time (``async_op``: on NCCL it runs on
    the collectives' stream while the compute stream runs the layer in hand) and waits
    for it only where that buffer is used. Every rank runs the same layers in the same
    order, so every rank records the same order and starts the same gathers at the
    same points; a guess that turns out wrong (a different path this time) only
    gathers a buffer that is then freed unused.

    Args:
        flats: the whole flat weight buffers (one per layer and dtype), freed.
        pieces: this rank's piece of each (tensors of their own).
        gather: ``gather(flat, piece, async_op=False)`` all-gathers the pieces into
            ``flat``, returning a handle to ``wait()`` on with ``async_op`` (None: the
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
        self.whole = collections.OrderedDict()  # whole buffers, least recently used first
        self.ahead = {}  # of those, the ones prefetched and not used yet: their handles
        self.orders = {}  # key: the order the last block of that key gathered in
        self.order = self.trace = None  # within ``active``: that order, and this block's
        self.gathers = 0  # how many all-gathers ran (for tests)
        self.prefetches = 0  # how many of them were started ahead of their use
        #: the buffers are in host memory (a CPU device), where the C heap holds them
        self.host = bool(self.flats) and self.flats[0].device.type == "cpu"
        # host memory: a freed buffer's memory is kept for the next buffer of its size
        # (``_grow`` / ``_free``): layer-sized blocks allocated and freed each step fragment
        # the C heap between the step's smaller tensors, which then grows by hundreds of
        # MB of free pages; on a GPU the caching allocator reuses them already
        self.spare = {} if self.host and hasattr(torch.UntypedStorage,
                                                 "_swap_data_ptr_") else None
        self.prefetch = HOST_PREFETCH if self.host else PREFETCH

    def ensure(self, k):
        """Buffer ``k`` whole (gathered now unless it is already, or waited for where
        its prefetch is under way); then the next buffer's prefetch started."""
        if k in self.whole and k not in self.ahead:
            self.whole.move_to_end(k)
            return
        self._make_room()
        if k in self.ahead:
            self._wait(k)
        else:
            flat = self.flats[k]
            self._grow(flat)
            with torch.no_grad():
                self.gather(flat, self.pieces[k])
            self.gathers += 1
        self.whole[k] = None
        self.whole.move_to_end(k)
        if self.trace is not None:
            self.trace.append(k)
            self._prefetch()

    def _make_room(self):
        """Free the least recently used of the buffers in use until one more fits
        (``KEEP``). The buffers prefetched are apart: the buffers in use, and so the
        gathers, are the same with and without a prefetch, and so is the order the next
        block follows."""
        while len(self.whole) - len(self.ahead) >= KEEP:
            self.release(next(k for k in self.whole if k not in self.ahead))

    def _prefetch(self):
        """Start the all-gather of the buffer the last block of this key gathered next,
        while the block follows that order (and that buffer is not whole)."""
        n = len(self.trace)
        if (not self.prefetch or not self.order or n >= len(self.order)
                or self.order[n - 1] != self.trace[-1]):
            return
        k = self.order[n]
        if k in self.whole:
            return
        while len(self.ahead) >= self.prefetch:  # a guess that was not used
            self.release(next(iter(self.ahead)))
        flat = self.flats[k]
        self._grow(flat)
        with torch.no_grad():
            self.ahead[k] = self.gather(flat, self.pieces[k], async_op=True)
        self.whole[k] = None
        self.gathers += 1
        self.prefetches += 1

    def _wait(self, k):
        """Buffer ``k``'s prefetch finished; it is in use from here on."""
        handle = self.ahead.pop(k)
        if handle is not None:  # (a test's stand-in may gather at once)
            handle.wait()

    def release(self, k):
        """Free buffer ``k`` (its prefetch, where one is under way, finished first)."""
        if k in self.ahead:
            self._wait(k)
        self.whole.pop(k, None)
        self._free(self.flats[k])

    def _grow(self, flat):
        """``grow``, with the memory of a freed buffer of the same size where one is kept
        (``spare``: its storage's memory swapped in, no allocation)."""
        st = flat.untyped_storage()
        need = flat.numel() * flat.element_size()
        kept = self.spare.get(need) if self.spare is not None else None
        if kept and st.nbytes() == 0:
            st._swap_data_ptr_(kept.pop())
        else:
            grow(flat)

    def _free(self, flat):
        """``free``, its memory kept in ``spare`` (moved into a storage of its own) where
        that is on."""
        st = flat.untyped_storage()
        if self.spare is None or st.nbytes() == 0:
            free(flat)
            return
        kept = torch.UntypedStorage(0, device=flat.device)
        kept._swap_data_ptr_(st)  # ``flat`` now holds no memory, ``kept`` its bytes
        self.spare.setdefault(kept.nbytes(), []).append(kept)

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
    def active(self, key="train"):
        """Within the block the weights are gathered where used (forward and backward),
        the next one ahead of its use in the order the last block of ``key`` gathered
        them; at its end every gathered buffer is freed."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.order, self.trace = self.orders.get(key), []
        try:
            with _Mode(self), hooks:
                yield
            self.orders[key] = self.trace
        finally:
            self.order = self.trace = None
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

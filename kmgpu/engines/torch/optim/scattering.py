"""shard="weights" on torch: each layer's gradient reduce-scattered into this rank's
piece as soon as the backward pass has made it (``zero.Shards.scattered``), so a rank
never holds the whole gradient (see ``fsdp`` for the weights' side).

A hook on each variable's torch Parameter keeps its gradient until its layer buffer's
are all there; then they are copied into a flat buffer as long as that layer's, whose
reduce-scatter into this rank's gradient piece (``zero.Shards.grad_pieces``, what the
update reads) starts at once; the gradients are let go (the hook hands autograd a
stand-in of no memory). Buffers with a variable that got no gradient go at the backward
pass's end, in buffer order, zeros for it (the update then refuses the step). Where the
gradient is all-reduced whole (clipnorm / global_clipnorm / a LossScaleOptimizer: the
norms and the finite check need every element) this is not used: the step's whole
gradient buffers are made and all-reduced after the backward pass instead, as with
shard="gradients".

Autograd runs the same graph's nodes in the same order on every rank, so the
reduce-scatters match across ranks.
"""

import contextlib
import functools

import torch

from kmgpu.engines import heap
from kmgpu.engines.torch.optim.fsdp import reduce_scatter


class Scattering:
    """This rank's gradient pieces, reduce-scattered one layer at a time as the backward
    pass produces each layer's gradients (see the module).

    A hook on each variable's torch Parameter (a leaf: its hook runs when its gradient
    is complete, before ``torch.autograd.grad`` takes it) keeps the gradient until
    every variable of its layer buffer has one; then the layer's flat gradient buffer
    is made (zeros: the padding), the gradients copied into it and let go, and its
    reduce-scatter into this rank's piece started (``async_op``: on NCCL it runs on the
    collectives' stream while the backward pass goes on to the layers before). Each hook
    returns a stand-in that holds no memory (a zero expanded to the gradient's shape), so
    autograd keeps none of the gradients either.

    The layer buffers take turns in ``slots`` scratch buffers per dtype (``SLOTS``,
    ``HOST_SLOTS`` on a CPU device), each as long as that dtype's largest layer, made at
    the first layer that needs them and let go at the backward pass's end (within a CUDA
    graph capture the caching allocator does not reuse memory a collective's stream used
    until the capture ends, so a new buffer per layer would leave every layer's in the
    graph's pool): a layer's copy into a slot first waits for the reduce-scatter that
    slot last started, and the block's end waits for all of them, before the update
    reads the pieces.

    Args:
        layout: the flat weights' ``flat_layout.Buffers`` (one buffer per layer and
            dtype).
        out: this rank's gradient piece of each buffer (written, in place).
        scatter: ``scatter(piece, flat, async_op=False)`` reduce-scatters ``flat`` into
            ``piece``, returning a handle to ``wait()`` on with ``async_op`` (None: the
            collective; tests pass their own).
    """

    #: scratch buffers per dtype: one layer's copy while the layer before's
    #: reduce-scatter is under way
    SLOTS = 2

    #: the same on a CPU device, whose buffers are host memory and whose reduce-scatters
    #: (gloo) run on the step's own cores: nothing to overlap, one layer's buffer less
    HOST_SLOTS = 1

    def __init__(self, layout, out, scatter=None):
        self.layout, self.out = layout, list(out)
        self.scatter = scatter or reduce_scatter
        self.group = {i: k for k, members in enumerate(layout.members) for i in members}
        self.longest = {}  # dtype: the longest layer buffer's length
        for flat in layout.flats:
            self.longest[flat.dtype] = max(self.longest.get(flat.dtype, 0), flat.numel())
        self.pending = None  # within ``active``: per buffer, {variable index: gradient}
        self.sent = None  # within ``active``: per buffer, reduce-scattered yet
        self.scratch = None  # within ``active``: {dtype: [[buffer, its handle], ...]}
        self.turn = None  # within ``active``: {dtype: the slot the next layer takes}
        self.kept = {}  # host memory: the last block's scratch, reused (see ``active``)
        #: the pieces, and so the scratch, are in host memory (a CPU device)
        self.host = bool(self.out) and self.out[0].device.type == "cpu"
        self.slots = self.HOST_SLOTS if self.host else self.SLOTS
        self.scatters = 0  # how many reduce-scatters ran (for tests)

    @contextlib.contextmanager
    def active(self, params):
        """Within the block a backward pass reduce-scatters each layer's gradient as soon
        as it is complete (``params``: the variables' torch Parameters, the layout's
        order, the tensors the backward pass differentiates for); at the block's end (no
        error) the buffers with a variable that got no gradient are reduce-scattered too
        (zeros for it), in buffer order, and every reduce-scatter is waited for: every
        rank runs the same graph, so every rank sends the same buffers in the same
        order."""
        self.pending = [{} for _ in self.layout.members]
        self.sent = [False] * len(self.layout.members)
        self.scratch, self.kept = self.kept, {}
        self.turn = {dtype: 0 for dtype in self.scratch}
        handles = [p.register_hook(functools.partial(self._arrived, i))
                   for i, p in enumerate(params)]
        try:
            yield
            for k, sent in enumerate(self.sent):
                if not sent:
                    self._send(k)
            for slots in self.scratch.values():
                for slot in slots:
                    self._wait(slot)
            if self.host:
                # host memory: kept for the next block; a slot made and freed each step
                # fragments the C heap (on a GPU the caching allocator already reuses)
                self.kept = self.scratch
        finally:
            for h in handles:
                h.remove()
            self.pending = self.sent = self.scratch = self.turn = None

    def _arrived(self, i, grad):
        k = self.group[i]
        self.pending[k][i] = grad
        if len(self.pending[k]) == len(self.layout.members[k]):
            self._send(k)
        return grad.new_zeros(()).expand(grad.shape)  # what autograd keeps: no memory

    @torch.no_grad()
    def _send(self, k):
        """Buffer ``k``'s gradients into a flat buffer as long as it (the next scratch
        slot), its reduce-scatter into this rank's piece started; the gradients let
        go."""
        got, piece = self.pending[k], self.out[k]
        if self.host:
            # host memory: the layers' gradient blocks autograd freed so far go back to
            # the system; each is split by the pass's smaller tensors before the next
            # layer's gradient asks for one, so a pass would otherwise hold one block per
            # layer until its end, at the price of a slower fit on CPU devices
            # (benchmarks/results/host-memory-cpu.md). On a GPU the caching allocator
            # reuses them.
            heap.trim_heap()
        slot = self._slot(piece)
        flat = slot[0][:self.layout.flats[k].numel()]
        flat.zero_()
        for i, view in zip(self.layout.members[k], self.layout.split(k, flat)):
            grad = got.pop(i, None)
            if grad is not None:
                view.copy_(grad)
            del grad
        slot[1] = self.scatter(piece, flat, async_op=True)
        self.sent[k] = True
        self.scatters += 1

    def _slot(self, piece):
        """The next scratch slot of ``piece``'s dtype, its last reduce-scatter finished
        (the slots made at the first use, on ``piece``'s device)."""
        slots = self.scratch.get(piece.dtype)
        if slots is None:
            n = self.longest[piece.dtype]
            slots = self.scratch[piece.dtype] = [[piece.new_empty(n), None]
                                                 for _ in range(self.slots)]
            self.turn[piece.dtype] = 0
        j = self.turn[piece.dtype]
        self.turn[piece.dtype] = (j + 1) % self.slots
        self._wait(slots[j])
        return slots[j]

    @staticmethod
    def _wait(slot):
        if slot[1] is not None:
            slot[1].wait()
            slot[1] = None

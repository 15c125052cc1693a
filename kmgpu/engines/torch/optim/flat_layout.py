"""The one flat-buffer container of the torch step: tensors laid out in one zero-padded
buffer per dtype, each an aligned view of it.

The weights and the optimizer's slots (``flat_optim``: the tensors become the views), the
split step's gradients with the averaged statistics after them (``split_step``: new
buffers) and ZeRO's pieces (``zero``) all use this layout, so a gradient buffer lines up
with the weights element for element and a rank's piece is one slice of each.

``generation`` is the one stale-graph signal: it counts the buffers made, so a CUDA graph
recorded when it had another value may read or write memory no longer in use.
"""

import torch

#: each tensor starts this many bytes into its flat buffer (padding between them stays
#: 0): the CUDA allocator gives every tensor 512-byte alignment and some kernels (cuDNN,
#: depthwise convolutions, vectorised loads) fault on views that lack it
ALIGN_BYTES = 256

#: how many ``Buffers`` were made in this process: tensors moved into new memory (the
#: weights, the optimizer's slots) or new gradient buffers; a graph recorded before
#: another one was made is stale (``eval_steps`` and the train step drop theirs)
generation = 0


def offsets(tensors, multiple=1):
    """(each tensor's offset in its flat buffer, the buffer's length), in elements; the
    length is a multiple of ``multiple`` aligned pieces (``zero``: one per rank)."""
    step = max(1, ALIGN_BYTES // tensors[0].element_size())
    out, n = [], 0
    for t in tensors:
        out.append(n)
        n += -(-t.numel() // step) * step
    whole = step * multiple
    return out, -(-n // whole) * whole


class Buffers:
    """Tensors laid out in one zero-padded flat buffer per dtype (dtypes in order of first
    appearance), each tensor a view starting ``ALIGN_BYTES``-aligned into its buffer.

    Each buffer has a head, its first ``lead`` tensors padded to ``multiple`` equal
    aligned pieces (the gradients, cut into one piece per rank by ZeRO), and a tail, the
    other tensors (the statistics the step averages); without ``lead`` every tensor is in
    the head.

    Args:
        tensors: the tensors, on one device.
        multiple: the head's length is a multiple of this many aligned pieces.
        lead: how many leading tensors form the heads (None: all).
        adopt: the tensors (torch Parameters) become the views, holding their values
            (``param.data = view``: the Parameter objects, hence Keras's variables and
            autograd, stay the same); else new buffers of zeros.
        groups: a group key per tensor (None: one group): one buffer per group and
            dtype, in order of first appearance (shard="weights" gathers one layer's
            buffer at a time).
        device: where new buffers go (None: the first tensor's device; ``adopt``
            keeps the tensors' own).
        lazy: no memory for the buffers yet (as after ``drop``): a layout that
            ``fresh`` fills, so a rank never allocates them whole here. With ``adopt``
            the tensors keep their own (unread) memory until ``move_freed``.

    Attributes:
        flats: the buffers; ``heads`` / ``tails``: their two parts (views).
        views: each tensor's view (with ``adopt``, the tensor itself).
        members: per buffer, the indices of its tensors, in order.
        start: each tensor's offset in its buffer.
    """

    def __init__(self, tensors, multiple=1, lead=None, adopt=False, groups=None, device=None,
                 lazy=False):
        global generation
        generation += 1
        tensors = list(tensors)
        lead = len(tensors) if lead is None else lead
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault((None if groups is None else groups[i], t.dtype), []).append(i)
        self.shapes = [t.shape for t in tensors]
        self.views, self.start = [None] * len(tensors), [0] * len(tensors)
        self.flats, self.heads, self.tails, self.members = [], [], [], []
        for members in by_dtype.values():
            head = [tensors[i] for i in members if i < lead]
            tail = [tensors[i] for i in members if i >= lead]
            where, n = offsets(head, multiple) if head else ([], 0)
            after, m = offsets(tail) if tail else ([], 0)
            first = tensors[members[0]]
            where_to = first.device if adopt or device is None else device
            if lazy:
                flat = torch.zeros(1, dtype=first.dtype, device=where_to).expand(n + m)
            else:
                flat = torch.zeros(n + m, dtype=first.dtype, device=where_to)
            with torch.no_grad():
                for i, o in zip(members, where + [n + o for o in after]):
                    t = tensors[i]
                    view = None if lazy else flat[o:o + t.numel()].view(t.shape)
                    if adopt and not lazy:
                        view.copy_(t)
                        t.data = view
                    self.views[i], self.start[i] = t if adopt else view, o
            self.flats.append(flat)
            self.heads.append(flat[:n])
            self.tails.append(flat[n:])
            self.members.append(members)

    def fresh(self, heads=True):
        """(new zeroed flat buffers laid out as these, one view per tensor of them, their
        heads, their tails): the same layout in other memory (``generation`` unchanged:
        a step that makes its gradient buffers anew each time, ``split_step``).
        ``heads`` False: only the buffers with a tail get memory (the statistics); the
        others stay as they are (after ``drop``: none), their tensors' views None."""
        kept = [heads or t.numel() > 0 for t in self.tails]
        flats = [torch.zeros(f.numel(), dtype=f.dtype, device=f.device) if keep else f
                 for f, keep in zip(self.flats, kept)]
        head = [f[:h.numel()] for f, h in zip(flats, self.heads)]
        tails = [f[h.numel():] for f, h in zip(flats, self.heads)]
        return flats, self.like([f if keep else None for f, keep in zip(flats, kept)]), \
            head, tails

    def drop(self):
        """Free the buffers' memory, keeping the layout (``fresh`` makes more): each flat
        becomes one element repeated (stride 0), as long as before."""
        self.flats = [f.new_zeros(1).expand(f.numel()) for f in self.flats]
        self.heads = [f[:h.numel()] for f, h in zip(self.flats, self.heads)]
        self.tails = [f[h.numel():] for f, h in zip(self.flats, self.heads)]
        self.views = [None] * len(self.views)

    def move_freed(self, device):
        """The adopted tensors onto ``device`` as views of new buffers whose memory is
        freed at once (values not kept; ``fsdp.grow`` gives it back): each buffer is
        made and freed in turn, so ``device`` never holds more than one of them."""
        for k, flat in enumerate(self.flats):
            new = torch.empty(flat.numel(), dtype=flat.dtype, device=device)
            for i, view in zip(self.members[k], self.split(k, new)):
                self.views[i].data = view
            n = self.heads[k].numel()
            self.flats[k], self.heads[k], self.tails[k] = new, new[:n], new[n:]
            new.untyped_storage().resize_(0)

    def split(self, k, flat):
        """Views of ``flat``, a buffer laid out as buffer ``k``: one per tensor of it."""
        return [flat[self.start[i]:self.start[i] + self.shapes[i].numel()].view(self.shapes[i])
                for i in self.members[k]]

    def like(self, flats):
        """Views of ``flats``, buffers laid out as these: one per tensor, in their order
        (None for the tensors of a buffer given as None)."""
        out = [None] * len(self.views)
        for k, flat in enumerate(flats):
            if flat is None:
                continue
            for i, view in zip(self.members[k], self.split(k, flat)):
                out[i] = view
        return out

    def overlaps(self, k, lo, hi):
        """(tensor index, a, b) for buffer ``k``'s tensors with elements in ``lo:hi``:
        those elements are ``a:b`` (buffer coordinates)."""
        out = []
        for i in self.members[k]:
            a = max(self.start[i], lo)
            b = min(self.start[i] + self.shapes[i].numel(), hi)
            if a < b:
                out.append((i, a, b))
        return out

    def spans(self, k, lo=0, hi=None):
        """Each of buffer ``k``'s tensors' span (its elements and the padding after it)
        inside ``lo:hi``, as a device tensor (summing to ``hi - lo``): what expands one
        number per tensor over the elements (``repeat_interleave``)."""
        flat = self.flats[k]
        hi = flat.numel() if hi is None else hi
        starts = [self.start[i] for i in self.members[k]]
        ends = starts[1:] + [flat.numel()]
        spans = [max(0, min(b, hi) - max(a, lo)) for a, b in zip(starts, ends)]
        return torch.tensor(spans, device=flat.device)


def layer_groups(variables):
    """shard="weights": each variable's group, the layer that owns it (its path without
    the variable's own name): one flat buffer per layer and dtype (``Buffers``' groups)."""
    return [v.path.rsplit("/", 1)[0] for v in variables]

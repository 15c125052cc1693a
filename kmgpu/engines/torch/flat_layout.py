"""The flat buffers of ``flat_optim``: one zero-padded tensor per dtype holding
many variables, each an aligned view of it (apart from ``flat_optim`` by role: the
layout here, the update there). ``split_step``'s gradient buffers and ``zero``'s
shards use the same layout (``offsets``)."""

import torch

#: each tensor starts this many bytes into its flat buffer (padding between them stays
#: 0): the CUDA allocator gives every tensor 512-byte alignment and some kernels (cuDNN,
#: depthwise convolutions, vectorised loads) fault on views that lack it
ALIGN_BYTES = 256


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


#: how many times ``flatten`` moved tensors into a new buffer: a CUDA graph recorded
#: before reads their old memory (``eval_steps`` drops its graphs when this changes)
generation = 0


def flatten(tensors, multiple=1):
    """Make ``tensors`` (torch Parameters of one dtype and device) views of one new
    zero-padded buffer holding their values, each at an ``ALIGN_BYTES`` offset
    (``param.data = view``: the Parameter objects, hence Keras's variables and autograd,
    stay the same). Returns the buffer."""
    global generation
    generation += 1
    where, n = offsets(tensors, multiple)
    flat = torch.zeros(n, dtype=tensors[0].dtype, device=tensors[0].device)
    with torch.no_grad():
        for t, o in zip(tensors, where):
            view = flat[o:o + t.numel()].view(t.shape)
            view.copy_(t)
            t.data = view
    return flat


class Group:
    """The variables of one dtype: their flat buffer, their slots' flat buffers."""

    def __init__(self, variables, slots, decayed, multiple=1):
        self.variables = variables
        self.offsets, self.numel = offsets([v.value for v in variables], multiple)
        self.params = flatten([v.value for v in variables], multiple)
        self.views = [v.value for v in variables]
        self.slots = {name: flatten([s.value for s in svars], multiple)
                      for name, svars in slots.items()}
        # weight decay: None (no decay), True (every variable), or the views it applies to
        self.decayed = (None if not any(decayed) else True if all(decayed)
                        else [w for w, d in zip(self.views, decayed) if d])
        self.constrained = [(v, w) for v, w in zip(variables, self.views)
                            if v.constraint is not None]
        # each variable's span (its elements and the padding after): clipnorm's expansion
        spans = [b - a for a, b in zip(self.offsets, self.offsets[1:] + [self.numel])]
        self.spans = torch.tensor(spans, device=self.params.device)

    def split(self, flat):
        return [flat[o:o + v.value.numel()].view(v.value.shape)
                for v, o in zip(self.variables, self.offsets)]

"""Tensor collectives over the ranks of an initialised ``torch.distributed`` group.

Few messages: tensors are packed per dtype into one flat buffer (dtypes gloo and
NCCL do not carry travel as a wider one). Used by the strategy; nothing here knows
Keras.
"""

import torch
import torch.distributed as dist

_WIRE = {torch.bool: torch.uint8, torch.uint16: torch.int32, torch.uint32: torch.int64,
         torch.uint64: torch.int64}


def _grouped(tensors):
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def broadcast_tensors(tensors, device, src=0):
    """Overwrite ``tensors`` (in place) with rank ``src``'s values, one message per dtype.

    Args:
        tensors: torch tensors, the same shapes and dtypes on every rank.
        device: where the collective's buffer lives (the rank's device).
        src: the rank whose values win.
    """
    with torch.no_grad():
        for dtype, idx in _grouped(tensors).items():
            wire = _WIRE.get(dtype, dtype)
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device, wire) for i in idx])
            dist.broadcast(flat, src)
            offset = 0
            for i in idx:
                t = tensors[i]
                t.copy_(flat[offset:offset + t.numel()].view(t.shape).to(t.device, dtype))
                offset += t.numel()


def sum_tensors(tensors, device):
    """The sums over ranks of ``tensors``.

    Args:
        tensors: torch tensors, the same shapes and dtypes on every rank.
        device: where the collective's buffer lives (the rank's device).

    Returns:
        New tensors (the inputs are untouched); half precision is summed in float64.
    """
    out = [None] * len(tensors)
    with torch.no_grad():
        for dtype, idx in _grouped(tensors).items():
            wire = (torch.float64 if dtype in (torch.float16, torch.bfloat16)
                    else _WIRE.get(dtype, dtype))
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device, wire) for i in idx])
            dist.all_reduce(flat)
            offset = 0
            for i in idx:
                t = tensors[i]
                out[i] = flat[offset:offset + t.numel()].view(t.shape).to(t.device, dtype)
                offset += t.numel()
    return out


def sum_gradients(state, bucket):
    """DDP comm hook: sum gradients over ranks (DDP's default averages them)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0]
    )


class SumOverRanks(torch.autograd.Function):
    """``dist.all_reduce`` (sum) with its gradient: the upstream gradients summed too.

    (``torch.distributed.nn.functional.all_reduce`` is this, deprecated in torch 2.13
    in favour of a private module.) Use ``SumOverRanks.apply(tensor)``.
    """

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        return grad


def all_gather_object(obj):
    """Every rank's ``obj`` (picklable), in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src=0):
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]

"""Random numbers computed on the device from a key tensor: capturable in a CUDA graph.

Keras's torch backend seeds a fresh ``torch.Generator`` with a host integer for every
draw from a ``SeedGenerator`` (``int(seed)``: a device-to-host copy CUDA-graph capture
refuses). Here a draw is a pure function of the seed generator's state, a device
tensor, and of each element's index: a counter-based hash (Salmon et al. 2011's idea,
with the integer finaliser of Wang/"lowbias32"), computed with int64 tensor ops whose
products stay below 2**63. The seed generator's state is advanced on the device, so a
replayed graph draws new numbers every step, a given seed repeats the same stream, and
the numbers are the same on a CPU and a GPU (same ops, same integers).
"""

import torch

M32 = 0xFFFFFFFF
_A, _B, _GOLDEN = 0x7FEB352D, 0x6A5D39EB, 0x61C88647  # odd, < 2**31


def mix(h):
    """A 32-bit integer hash of ``h`` (int64 tensor or python int, values < 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _A) & M32
    h = h ^ (h >> 15)
    h = (h * _B) & M32
    return h ^ (h >> 16)


def bits(n, key, device):
    """``n`` pseudo-random 32-bit integers (int64 tensor) for ``key`` = (k0, k1).

    ``k0`` / ``k1`` are int64 0-d device tensors or python ints; nothing is read back.
    """
    k0, k1 = key
    a = mix((k0 & M32) ^ 0x2545F491)
    b = mix((((k1 & M32) + 0x9E3779B9) & M32) ^ a)
    index = torch.arange(n, dtype=torch.int64, device=device)
    return mix(mix(((index * _GOLDEN) & M32) ^ a) ^ b)


def uniform(n, key, device, open_low=False):
    """``n`` float32 numbers uniform in [0, 1) (``open_low``: in (0, 1))."""
    u = (bits(n, key, device) >> 8).to(torch.float32)
    if open_low:
        u = u + 0.5
    return u * (1.0 / 2**24)


def normal(n, key, device):
    """``n`` float32 standard normal numbers (Box-Muller on two uniform halves)."""
    u = uniform(2 * n, key, device, open_low=True)
    u1, u2 = u[:n], u[n:]
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)

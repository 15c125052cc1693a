"""Kernels by category under torch.profiler, and CUDA-event timing: the measuring half of
``torch_kernels.py`` (and of ``torch_fast_ops.py``), which run the models.

``profile_torch(fn, steps, gpu)`` runs ``fn`` under the profiler and puts each kernel in
one of ``CATEGORIES`` by its name and the ops that launched it (``categorise``);
``labelled`` and ``label_optimizer`` name BatchNormalization's calls and the optimizer's
update for it; ``blocks`` and ``timed`` give ms per step. On a CPU the leaf aten ops stand
for kernels and the times are CPU times.
"""

import functools
import statistics
import time

CATEGORIES = ("conv/matmul", "batchnorm", "optimizer", "elementwise", "copies/permutes",
              "other")


CONV = ("conv", "gemm", "cutlass", "nvjet", "xmma", "wgrad", "dgrad", "fprop", "winograd",
        "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
        "scaled_dot_product", "flash", "fmha", "cublas")
COPY = ("copy", "memcpy", "nchwtonhwc", "nhwctonchw", "transpose", "contiguous", "clone",
        "aten::cat", "catarray")
ELEMENTWISE = ("elementwise", "reduce", "vectorized", "unrolled", "softmax", "welford",
               "aten::")
BN_NAMES = ("batch_norm", "bn_fw", "bn_bw", "batchnorm")


def _chain(e):
    out = []
    while e is not None:
        out.append(e.name)
        e = e.cpu_parent
    return out


def categorise(kernel, chain, bn_backward):
    """The category of one kernel: its name, and the names of its launching op and that
    op's ancestors (innermost first)."""
    names = [n.lower() for n in chain]
    if any("kmgpu::optimizer" in n or n.startswith("optimizer.step") for n in names):
        return "optimizer"
    if any("kmgpu::batchnorm" in n for n in names) or bn_backward:
        return "batchnorm"
    k = kernel.lower()
    if any(b in k for b in BN_NAMES) or any(any(b in n for b in BN_NAMES) for n in names[:2]):
        return "batchnorm"
    leaf = names[0] if names else ""
    if any(c in k for c in ("nchwtonhwc", "nhwctonchw", "memcpy", "copy")) or any(
            c in leaf for c in COPY):
        return "copies/permutes"
    if any(c in k for c in CONV) or any(any(c in n for c in CONV) for n in names):
        return "conv/matmul"
    if "memset" in k or "fill" in k:
        return "other"
    if any(c in k for c in ELEMENTWISE):
        return "elementwise"
    return "other"


def profile_torch(fn, steps, gpu):
    """Run ``fn()`` ``steps`` times under torch.profiler: per step, (kernels by category:
    {category: [count, us]}, kernels the profiler saw on the device in total (CUDA-graph
    replays included), their us)."""
    import torch

    events = recorded(fn, steps, gpu)
    table = {c: [0, 0.0] for c in CATEGORIES}
    for _, _, us, c, _ in _kernels(events, gpu):
        table[c][0] += 1
        table[c][1] += us
    device = [e for e in events if gpu and e.device_type == torch.autograd.DeviceType.CUDA]
    dev_us = sum(e.time_range.elapsed_us() for e in device)
    per = {c: [n / steps, us / steps / 1e3] for c, (n, us) in table.items()}
    return per, len(device) / steps, dev_us / steps / 1e3


def top_kernels(fn, steps, gpu, category, top):
    """The ``top`` (launching ops, kernel) pairs of ``category`` by GPU time per step, when
    ``fn()`` runs ``steps`` times under the profiler: [(ops, kernel, count, ms), ...]. "ops"
    is the launching op and up to two of its callers, innermost first, with the launching
    op's first input shape: it tells apart, say, a copy of a kernel from one of an
    activation."""
    found = {}
    for chain, name, us, c, shape in _kernels(recorded(fn, steps, gpu, shapes=True), gpu):
        if c == category:
            ops = " < ".join(n.replace("autograd::engine::evaluate_function: ", "")
                             for n in chain[:3])
            key = (f"{ops} {shape}" if shape else ops, name[:70])
            n, t = found.get(key, (0, 0.0))
            found[key] = (n + 1, t + us)
    rows = sorted(found.items(), key=lambda kv: -kv[1][1])[:top]
    return [(op, k, n / steps, us / steps / 1e3) for (op, k), (n, us) in rows]


def _kernels(events, gpu):
    """(launching op's chain, kernel name, us, category, the launching op's first input
    shape or None: events recorded without ``shapes``) of each kernel the host events
    launched (on a CPU: each leaf aten op, standing for a kernel)."""
    import torch

    bn_seq = set()  # forward ops made inside BatchNormalization.call (their sequence numbers)
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::") and any(
                "kmgpu::batchnorm" in n for n in _chain(e)):
            bn_seq.add(e.sequence_nr)
    for e in events:
        if gpu and e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        chain = _chain(e)
        bn_back = any(n.startswith("autograd::engine::evaluate_function")
                      for n in chain) and _backward_seq(e) in bn_seq
        if gpu:
            kernels = [(k.name, k.duration) for k in e.kernels]
        elif not e.cpu_children and not e.name.startswith(("kmgpu::", "autograd::")):
            kernels = [(e.name, e.self_cpu_time_total)]
        else:
            kernels = []
        shapes = [x for x in (e.input_shapes or []) if x]
        for name, us in kernels:
            yield (chain, name, us, categorise(name, chain, bn_back),
                   tuple(shapes[0]) if shapes else None)


def recorded(fn, steps, gpu, shapes=False):
    """The torch.profiler events of ``fn()`` run ``steps`` times (CUDA activity too on a GPU,
    synchronised before the profile ends; ``shapes``: with the ops' input shapes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts, record_shapes=shapes) as prof:
        for _ in range(steps):
            fn()
        if gpu:
            torch.cuda.synchronize()
    return prof.events()


def _backward_seq(e):
    """The sequence number of the autograd node (backward) that ``e`` runs inside."""
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return e.sequence_nr
        e = e.cpu_parent
    return None


def labelled():
    """Label BatchNormalization.call (this process only) for the profiler."""
    import keras
    from torch.profiler import record_function

    cls = keras.layers.BatchNormalization
    if getattr(cls.call, "_kmgpu_label", False):
        return
    call = cls.call

    @functools.wraps(call)  # Keras reads call's signature
    def wrapped(self, *a, **k):
        with record_function("kmgpu::batchnorm"):
            return call(self, *a, **k)

    wrapped._kmgpu_label = True
    cls.call = wrapped


def label_optimizer(optimizer):
    from torch.profiler import record_function

    apply = optimizer.apply

    def wrapped(*a, **k):
        with record_function("kmgpu::optimizer"):
            return apply(*a, **k)

    optimizer.apply = wrapped


def blocks(fn, steps, gpu):
    """ms per step of each of 3 blocks of ``steps`` calls (synchronised on a GPU)."""
    import torch

    out = []
    for _ in range(3):
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        if gpu:
            torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t) / steps)
    return out


def timed(fn, steps, gpu):
    """ms per step: the median of ``blocks``."""
    return statistics.median(blocks(fn, steps, gpu))

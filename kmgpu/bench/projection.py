"""Scaling past the GPUs we have: an alpha-beta model of data-parallel training, fed with
what the run measured. Pure arithmetic (no numpy, no backend): the figures can be checked
by hand, and again when larger machines are lent.

Measured inputs, per backend and workload:
    t_c   compute time of one step on one GPU at the workload's batch: the global batch
          over plain ``fit``'s samples/s (so it includes ``fit``'s per-step overhead)
    M     gradient bytes all-reduced per step: trainable parameters x 4 (float32)
    alpha, busbw   from the all-reduce sweep on the GPUs of the run (p0 of them, usually
          2): the time of one all-reduce of M bytes fitted (least squares of the
          relative error) to
          t(M) = 2 (p0-1) alpha + 2 (p0-1)/p0 x M / busbw  (``fit_alpha_beta``)

The model:
    ring all-reduce over p GPUs of one host (NVLink through NVSwitch: every GPU keeps its
    measured bus bandwidth at any p <= gpus_per_host):
        T_ar(p, M) = 2 (p-1) alpha + 2 (p-1)/p x M / busbw
    over h hosts of g GPUs (hierarchical: reduce-scatter and all-gather inside each host,
    the hosts' ring all-reduce over one network link of net_bw per host, which carries
    2 (h-1)/h x M in all for the host's g GPUs):
        T_ar = 2 (g-1) alpha + 2 (g-1)/g x M / busbw + 2 (h-1) net_alpha + 2 (h-1)/h x M / net_bw
    compute per GPU: t_c / p with the "global" policy (the batch is split: strong scaling;
    optimistic, small per-GPU batches lose efficiency), t_c with "per_replica" (weak).
    step without overlap:  T = t_c(p) + T_ar
    step with overlap of the all-reduce with the backward pass (bucketed, as DDP and XLA
    do; the backward pass is 2/3 of the step's compute):
                           T = t_c(p) + max(0, T_ar - 2/3 t_c(p))
    efficiency = samples/s(p) / (p x samples/s(1)) = t_c(p) / T

Not in the model: BatchNorm statistics (JAX DataParallel all-reduces each BatchNorm's
moments inside the forward pass), input feeding, stragglers; the 2-GPU column sets the
projection against the measured efficiency.
"""

GPUS_PER_HOST = 8
NET_GBPS = 400.0  # per host, Gb/s
NET_LATENCY_US = 10.0  # per inter-host step of the ring (an assumption, not measured)
BACKWARD_FRACTION = 2.0 / 3.0
BYTES_PER_GRADIENT = 4  # float32 variables (also under a mixed policy)
COUNTS = (2, 4, 8, 16, 32, 64)


def fit_alpha_beta(points, p):
    """Fit t(M) = a + b M to [(bytes, seconds), ...] measured on ``p`` GPUs, by least
    squares of the relative error (weights 1/t^2: the small messages set the latency, the
    large ones the bandwidth); returns (alpha seconds per step, bus bandwidth bytes/s) of
    the ring model: a = 2 (p-1) alpha, b = 2 (p-1) / (p busbw). alpha is clipped at 0."""
    if p < 2 or len(points) < 2:
        raise ValueError("the fit needs at least 2 message sizes measured on 2+ GPUs")
    w = [1.0 / float(t) ** 2 for _, t in points]
    xs = [float(m) for m, _ in points]
    ys = [float(t) for _, t in points]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("the fit needs different message sizes")
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if b <= 0:
        raise ValueError("all-reduce time does not grow with the message size")
    return max(a, 0.0) / (2 * (p - 1)), 2 * (p - 1) / (p * b)


def bus_bandwidth(message_bytes, seconds, p):
    """nccl-tests' bus bandwidth of one all-reduce: M / t x 2 (p-1) / p."""
    return message_bytes / seconds * 2 * (p - 1) / p


def ring_time(p, message_bytes, alpha, busbw):
    """T_ar of a ring all-reduce of ``message_bytes`` over ``p`` GPUs of one host."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * message_bytes / busbw


def allreduce_time(p, message_bytes, alpha, busbw, gpus_per_host=GPUS_PER_HOST,
                   net_gbps=NET_GBPS, net_latency_us=NET_LATENCY_US):
    """T_ar over ``p`` GPUs: one host up to ``gpus_per_host``, else hierarchical over
    ceil(p / gpus_per_host) hosts (see the module docstring)."""
    if p <= gpus_per_host:
        return ring_time(p, message_bytes, alpha, busbw)
    hosts = -(-p // gpus_per_host)
    net_bw = net_gbps * 1e9 / 8
    inside = ring_time(gpus_per_host, message_bytes, alpha, busbw)
    between = (2 * (hosts - 1) * net_latency_us * 1e-6
               + 2 * (hosts - 1) / hosts * message_bytes / net_bw)
    return inside + between


def step_time(compute, allreduce, overlap, backward_fraction=BACKWARD_FRACTION):
    """One step: compute plus the all-reduce, or plus only what the backward pass does
    not hide."""
    if overlap:
        return compute + max(0.0, allreduce - backward_fraction * compute)
    return compute + allreduce


def efficiency(p, policy, compute_1, message_bytes, alpha, busbw, overlap, **net):
    """Projected scaling efficiency on ``p`` GPUs: t_c(p) / T (module docstring)."""
    compute = compute_1 / p if policy == "global" else compute_1
    t = step_time(compute, allreduce_time(p, message_bytes, alpha, busbw, **net), overlap)
    return compute / t


def project(compute_1, message_bytes, alpha, busbw, policy, counts=COUNTS, **net):
    """{p: (efficiency without overlap, with overlap)} for each GPU count."""
    return {p: (efficiency(p, policy, compute_1, message_bytes, alpha, busbw, False, **net),
                efficiency(p, policy, compute_1, message_bytes, alpha, busbw, True, **net))
            for p in counts}


def describe(params=None):
    """The model and its assumed parameters, as markdown lines for the report."""
    params = params or {}
    g = params.get("gpus_per_host", GPUS_PER_HOST)
    gbps = params.get("net_gbps", NET_GBPS)
    lat = params.get("net_latency_us", NET_LATENCY_US)
    return [
        "Model (alpha-beta, `kmgpu/bench/projection.py`): t_c = compute time of one step on "
        "one GPU (global batch / plain fit samples/s); M = gradient bytes per step "
        "(trainable parameters x 4); alpha, busbw fitted by least squares to the all-reduce "
        "sweep on the run's GPUs, t(M) = 2(p-1)alpha + 2(p-1)/p x M/busbw.",
        f"- one host (p <= {g}, NVLink/NVSwitch, measured busbw at any p): "
        "T_ar = 2(p-1)alpha + 2(p-1)/p x M/busbw",
        f"- h hosts of {g} GPUs ({gbps:g} Gb/s per host, {lat:g} us per inter-host ring step, "
        f"assumed): T_ar = 2({g}-1)alpha + 2({g}-1)/{g} x M/busbw + 2(h-1) x {lat:g} us + "
        f"2(h-1)/h x M/{gbps / 8:g} GB/s",
        "- compute per GPU t_c(p) = t_c/p (policy global, strong scaling; optimistic: small "
        "per-GPU batches lose efficiency) or t_c (per_replica, weak scaling)",
        "- step T = t_c(p) + T_ar (no overlap) or t_c(p) + max(0, T_ar - 2/3 t_c(p)) "
        "(all-reduce overlapped with the backward pass); efficiency = t_c(p) / T",
        "- not modelled: BatchNorm all-reduces inside the forward pass (JAX DataParallel), "
        "input feeding, stragglers; compare the projected and measured 2-GPU columns.",
    ]

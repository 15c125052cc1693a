"""Where does one Keras-on-torch training step go, and what takes the host out of it?

Standalone: needs only torch (+ torchvision for the reference part) and keras 3.15.1.
Run with KERAS_BACKEND=torch on one GPU:

    KERAS_BACKEND=torch python benchmarks/profiles/torch/step_profile.py --out /tmp/prof

Parts (``--parts``, comma separated, run in the order given, each skipped when the
global ``--budget-s`` would be overrun; compile parts also have ``--compile-timeout-s``):

    fit        (a) plain ``model.fit`` on numpy arrays, samples/s (2nd epoch; verbose=0)
    prof       (b) torch.profiler of the hand step (same ops as Keras's train_step):
                   Python/Keras host time vs time inside torch ops vs CUDA kernel time,
                   kernel launches, syncs and H2D copies per step, layout copies, top ops
    pyprof         cProfile of one hand step: which Keras Python functions cost
    hand       (d) hand loop around the same model: model(x, training=True), loss,
                   backward, Keras optimizer.apply; data already on the GPU; plus the
                   cost of fit's numpy batch slice + host->device copy alone
    scalar         the hand loop with Keras's python-scalar -> CUDA tensor conversion
                   made sync-free (torch.full on the device instead of a blocking H2D copy)
    cudagraph  (e) the whole hand step (forward, backward, Keras Adam) captured in one
                   CUDA graph (torch.cuda.graph) and replayed; exactness vs eager (TF32 off).
                   Needs the sync-free scalar conversion of ``scalar`` (applied here).
    compile    (e) torch.compile(forward+loss) (inductor, default mode), backward and the
                   Keras optimizer eager; compile time, graph breaks, speed, exactness
    jitfit     (c) ``model.compile(jit_compile=True)`` + fit: Keras torch.compile's its
                   whole train step; first-epoch (compile) time, speed, graph breaks
    tv         (f) torchvision resnet50, channels_last, plain loop, torch Adam (ResNet only)

Models (``--models``): resnet50_64 (ResNet-50, 64x64, batch 256), xception_224
(Xception, 224x224, batch 32). ``--quick`` shrinks everything for a CPU smoke test.
Results go to ``<out>/results.json`` after every part; the table is printed at the end
(``--table <results.json>`` reprints it).
"""

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import signal
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

T0 = time.perf_counter()
RESULTS = {"meta": {}, "runs": {}}
ANNOT = ("kstep", "k_data", "k_forward", "k_loss", "k_backward", "k_optimizer")


# --------------------------------------------------------------------------- utils
def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds):
    if seconds is None or seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise PartTimeout(f"timed out after {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(int(max(1, seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def save(out):
    if out:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def record(model_name, part, value):
    RESULTS["runs"].setdefault(model_name, {})[part] = value


@contextlib.contextmanager
def tf32(enabled):
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# --------------------------------------------------------------------------- models
SPECS = {
    "resnet50_64": dict(app="ResNet50", size=64, batch=256),
    "xception_224": dict(app="Xception", size=224, batch=32),
}
QUICK = {
    "resnet50_64": dict(app="ResNet50", size=32, batch=4),
    "xception_224": dict(app="Xception", size=71, batch=2),
}


def spec(name, quick):
    return (QUICK if quick else SPECS)[name]


def build(name, quick):
    import keras

    s = spec(name, quick)
    keras.utils.set_random_seed(1234)
    app = getattr(keras.applications, s["app"])
    return app(weights=None, input_shape=(s["size"], s["size"], 3), classes=10,
               classifier_activation=None)


def numpy_data(name, quick, nbatches):
    s = spec(name, quick)
    rng = np.random.default_rng(0)
    n = s["batch"] * nbatches
    x = rng.random((n, s["size"], s["size"], 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    return x, y


def device_batches(name, quick, nbatches, dev):
    x, y = numpy_data(name, quick, nbatches)
    b = spec(name, quick)["batch"]
    xs = [torch.from_numpy(x[i * b:(i + 1) * b]).to(dev) for i in range(nbatches)]
    ys = [torch.from_numpy(y[i * b:(i + 1) * b]).to(dev) for i in range(nbatches)]
    return xs, ys


def keras_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_adam():
    import keras

    return keras.optimizers.Adam(learning_rate=1e-3)


class HandStep:
    """Keras's torch train_step without fit: forward, loss, backward, optimizer.apply."""

    def __init__(self, model, forward_loss=None, annotate=False):
        self.model = model
        self.loss_fn = keras_loss()
        self.opt = keras_adam()
        self.tw = model.trainable_weights
        self.opt.build(self.tw)
        self.forward_loss = forward_loss or self.eager_forward_loss
        self.annotate = annotate

    def eager_forward_loss(self, x, y):
        return self.loss_fn(y, self.model(x, training=True))

    def region(self, name):
        if self.annotate:
            return torch.profiler.record_function(name)
        return contextlib.nullcontext()

    def __call__(self, x, y):
        with self.region("k_forward"):
            loss = self.forward_loss(x, y)
        self.model.zero_grad()
        with self.region("k_backward"):
            loss.backward()
        with self.region("k_optimizer"):
            grads = [v.value.grad for v in self.tw]
            with torch.no_grad():
                self.opt.apply(grads, self.tw)
        return loss

    # state snapshot / restore, in place (keeps parameter identity for CUDA graphs)
    def state(self):
        return [v.value for v in self.model.weights] + [v.value for v in self.opt.variables]

    def snapshot(self):
        return [t.detach().clone() for t in self.state()]

    def restore(self, snap):
        with torch.no_grad():
            for t, s in zip(self.state(), snap):
                t.copy_(s)


def time_steps(fn, xs, ys, steps):
    sync()
    t = time.perf_counter()
    for i in range(steps):
        fn(xs[i % len(xs)], ys[i % len(ys)])
    sync()
    return (time.perf_counter() - t) / steps


def rel_diff(a_list, b_list):
    """max over tensors of ||a-b||/||b|| and the global ||a-b||/||b|| (float64)."""
    worst, num, den = 0.0, 0.0, 0.0
    for a, b in zip(a_list, b_list):
        a = a.double()
        b = b.double()
        d = float((a - b).norm())
        n = float(b.norm())
        num += d * d
        den += n * n
        if n > 0:
            worst = max(worst, d / n)
    return {"max_tensor_rel": worst, "global_rel": (num ** 0.5) / max(den ** 0.5, 1e-30)}


# --------------------------------------------------------------------------- parts
def part_fit(name, quick, dev, args, jit=False):
    import keras

    model = build(name, quick)
    b = spec(name, quick)["batch"]
    x, y = numpy_data(name, quick, args.fit_steps)
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            sync()
            self.t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            sync()
            times.append(time.perf_counter() - self.t)

    res = {}
    if jit:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
    model.compile(optimizer=keras_adam(), loss=keras_loss(), jit_compile=jit)
    res["jit_compile_attr"] = bool(model.jit_compile)
    model.fit(x, y, batch_size=b, epochs=2, verbose=0, callbacks=[Timer()])
    res["epoch_s"] = times
    res["first_epoch_s"] = times[0]
    res["samples_per_s"] = len(x) / times[-1]
    res["ms_per_step"] = 1000 * times[-1] / args.fit_steps
    if jit:
        res.update(dynamo_stats())
    return res


def dynamo_stats():
    from torch._dynamo.utils import counters

    breaks = dict(counters.get("graph_break", {}))
    stats = dict(counters.get("stats", {}))
    top = sorted(breaks.items(), key=lambda kv: -kv[1])[:8]
    return {
        "graph_breaks": int(sum(breaks.values())),
        "unique_graphs": int(stats.get("unique_graphs", 0)),
        "calls_captured": int(stats.get("calls_captured", 0)),
        "top_break_reasons": [[str(k)[:300], v] for k, v in top],
    }


def part_data(name, quick, dev, args):
    """fit's per-step input path alone: numpy random-row gather + blocking H2D copy."""
    from keras.src.backend.torch.core import convert_to_tensor

    b = spec(name, quick)["batch"]
    x, y = numpy_data(name, quick, 4)
    rng = np.random.default_rng(1)
    reps = 6
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        idx = rng.permutation(len(x))[:b]
        xt = convert_to_tensor(x[idx])
        yt = convert_to_tensor(y[idx])
    sync()
    del xt, yt
    return {"ms_per_batch": 1000 * (time.perf_counter() - t) / reps}


def part_hand(name, quick, dev, args, ctx):
    step = ctx.hand(name)
    xs, ys = ctx.batches(name)
    for i in range(3):
        step(xs[i], ys[i])
    ms = 1000 * time_steps(step, xs, ys, args.steps)
    b = spec(name, quick)["batch"]
    res = {"ms_per_step": ms, "samples_per_s": 1000 * b / ms}
    # forward+loss alone (no backward): how much of the step is the forward's host work
    sync()
    t = time.perf_counter()
    for i in range(args.steps):
        step.forward_loss(xs[i % len(xs)], ys[i % len(ys)])
        step.model.zero_grad()
    sync()
    res["forward_loss_ms"] = 1000 * (time.perf_counter() - t) / args.steps
    try:
        res["data_path"] = part_data(name, quick, dev, args)
    except Exception as e:  # pragma: no cover
        res["data_path"] = {"error": repr(e)}
    return res


def analyse_profile(prof, nsteps):
    from torch.autograd import DeviceType

    evts = prof.events()
    steps = [e for e in evts if e.name == "kstep"]
    main_tid = steps[0].thread if steps else None
    res = {}
    per = lambda v: v / max(nsteps, 1)  # noqa: E731

    # device side
    kernels = [e for e in evts if e.device_type == DeviceType.CUDA]
    # (record_function ranges also appear on the GPU timeline as user annotations)
    kernels = [e for e in kernels if e.name not in ANNOT]
    kern = [e for e in kernels if not e.name.startswith(("Memcpy", "Memset"))]
    memcpy = [e for e in kernels if e.name.startswith("Memcpy")]
    res["gpu_kernel_ms"] = per(sum(e.time_range.elapsed_us() for e in kern) / 1000)
    res["kernels"] = per(len(kern))
    res["memcpy_dev_events"] = per(len(memcpy))
    res["memcpy_htod"] = per(sum(1 for e in memcpy if "HtoD" in e.name))
    res["memset"] = per(sum(1 for e in kernels if e.name.startswith("Memset")))

    cpu = [e for e in evts if e.device_type == DeviceType.CPU]

    def count(names):
        return per(sum(1 for e in cpu if e.name in names))

    res["cudaLaunchKernel"] = count({"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                     "cuLaunchKernelEx"})
    res["stream_syncs"] = count({"cudaStreamSynchronize", "cudaDeviceSynchronize",
                                 "cudaEventSynchronize"})
    res["cudaMemcpyAsync"] = count({"cudaMemcpyAsync"})

    # host side, main thread: region wall vs time inside top-level torch ops
    def ancestors(e):
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    regions = {}
    for e in cpu:
        if e.name in ANNOT and e.name != "kstep":
            r = regions.setdefault(e.name, {"wall_ms": 0.0, "ops_ms": 0.0, "ops": 0})
            r["wall_ms"] += e.cpu_time_total / 1000
    other_thread_ops = 0.0
    for e in cpu:
        if e.name in ANNOT:
            continue
        anc = list(ancestors(e))
        if any(a.name not in ANNOT for a in anc):
            continue  # nested inside another op
        if e.thread != main_tid:
            other_thread_ops += e.cpu_time_total / 1000
            continue
        reg = next((a.name for a in anc if a.name in ANNOT and a.name != "kstep"), "k_other")
        r = regions.setdefault(reg, {"wall_ms": 0.0, "ops_ms": 0.0, "ops": 0})
        r["ops_ms"] += e.cpu_time_total / 1000
        r["ops"] += 1
    for r in regions.values():
        for k in list(r):
            r[k] = per(r[k])
        r["python_ms"] = max(0.0, r["wall_ms"] - r["ops_ms"])
    res["regions"] = regions
    res["step_wall_ms"] = per(sum(e.cpu_time_total for e in steps) / 1000)
    res["autograd_thread_ops_ms"] = per(other_thread_ops)

    # device events by name (CUPTI sync/wait activities would inflate a plain sum)
    by_name = {}
    for e in kernels:
        d = by_name.setdefault(e.name[:80], [0, 0.0])
        d[0] += 1
        d[1] += e.time_range.elapsed_us() / 1000
    res["top_device_events"] = sorted(([k, per(v[0]), per(v[1])] for k, v in by_name.items()),
                                      key=lambda r: -r[2])[:8]
    res["device_events_sum_ms"] = res.pop("gpu_kernel_ms")

    # op table
    table = []
    for a in prof.key_averages():
        self_dev = getattr(a, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(a, "self_cuda_time_total", 0)
        table.append({"name": a.key, "count": per(a.count),
                      "self_cpu_ms": per(a.self_cpu_time_total / 1000),
                      "self_dev_ms": per(self_dev / 1000)})
    table = [t for t in table if t["name"] not in ANNOT]
    res["top_self_cpu"] = sorted(table, key=lambda t: -t["self_cpu_ms"])[:15]
    layout = {"aten::copy_", "aten::permute", "aten::contiguous", "aten::clone",
              "aten::_to_copy", "aten::to", "aten::transpose", "aten::pad",
              "aten::constant_pad_nd"}
    res["layout_ops"] = [t for t in table if t["name"] in layout]
    res["layout_copy_dev_ms"] = sum(t["self_dev_ms"] for t in table if t["name"] in
                                    {"aten::copy_", "aten::clone", "aten::contiguous",
                                     "aten::constant_pad_nd"})
    res["gpu_kernel_ms"] = sum(t["self_dev_ms"] for t in table)  # kernels attributed to ops
    res["aten_ops_per_step"] = sum(t["count"] for t in table if t["name"].startswith("aten::"))
    return res


def part_prof(name, quick, dev, args, ctx):
    from torch.profiler import ProfilerActivity, profile

    step = ctx.hand(name)
    xs, ys = ctx.batches(name)
    for i in range(2):
        step(xs[i], ys[i])
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    step.annotate = True
    n = args.prof_steps
    try:
        with profile(activities=acts) as prof:
            for i in range(n):
                with torch.profiler.record_function("kstep"):
                    step(xs[i % len(xs)], ys[i % len(ys)])
            sync()
    finally:
        step.annotate = False
    res = analyse_profile(prof, n)
    if args.out:
        if args.trace:
            with contextlib.suppress(Exception):
                prof.export_chrome_trace(os.path.join(args.out, f"trace_{name}.json"))
        with open(os.path.join(args.out, f"ops_{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    return res


def part_pyprof(name, quick, dev, args, ctx):
    step = ctx.hand(name)
    xs, ys = ctx.batches(name)
    step(xs[0], ys[0])
    sync()
    pr = cProfile.Profile()
    pr.enable()
    step(xs[1], ys[1])
    sync()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(25)
    text = s.getvalue()
    if args.out:
        with open(os.path.join(args.out, f"pyprof_{name}.txt"), "w") as f:
            f.write(text)
            s2 = io.StringIO()
            pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(40)
            f.write(s2.getvalue())
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append((tt, nc, f"{os.path.basename(fname)}:{func}"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return {"total_s_profiled": total,
            "top_tottime": [[f, n, round(1000 * t, 2)] for t, n, f in rows[:15]]}


_SCALAR_PATCHED = {}


def patch_scalar_conversion(on):
    """Make keras's convert_to_tensor(python scalar) build the tensor on the device
    (torch.full) instead of torch.as_tensor(..., device=cuda), which copies from
    pageable host memory and synchronises the stream. Swaps the function's code so
    that every module that imported convert_to_tensor by name sees it."""
    from keras.src.backend.torch import core

    f = core.convert_to_tensor
    if on:
        if "code" in _SCALAR_PATCHED:
            return
        import types

        core._kprof_orig_convert = types.FunctionType(
            f.__code__, f.__globals__, "orig_convert", f.__defaults__, f.__closure__)
        _SCALAR_PATCHED["code"] = f.__code__

        core._kprof_const_cache = {}
        core._kprof_patch_cpu = bool(os.environ.get("KPROF_PATCH_CPU"))

        def fast(x, dtype=None, sparse=None, ragged=None):
            tx = type(x)
            if tx in (float, int, bool) and not sparse and not ragged:
                dev = get_device()  # noqa: F821  (resolved in keras's core module)
                if str(dev) != "meta" and (getattr(dev, "type", str(dev)) != "cpu"
                                           or _kprof_patch_cpu):  # noqa: F821
                    if dtype is not None:
                        dt = to_torch_dtype(dtype)  # noqa: F821
                    elif tx is bool:
                        dt = torch.bool
                    elif tx is int:
                        dt = torch.int64 if x < -(2**31) or x >= 2**31 else torch.int32
                    else:
                        dt = to_torch_dtype(floatx())  # noqa: F821
                    return torch.full((), x, dtype=dt, device=dev)
            elif (tx in (tuple, list) and not sparse and not ragged
                  and all(type(e) in (int, float, bool) for e in x)):
                # small constant lists (e.g. a loss's ops.shape(values)): one device
                # tensor per value, made once (before any CUDA-graph capture)
                key = (tx, tuple(x), tuple(type(e) for e in x), str(dtype), str(get_device()))  # noqa: F821
                t = _kprof_const_cache.get(key)  # noqa: F821
                if t is None:
                    t = _kprof_orig_convert(x, dtype, sparse, ragged)  # noqa: F821
                    _kprof_const_cache[key] = t  # noqa: F821
                return t
            return _kprof_orig_convert(x, dtype, sparse, ragged)  # noqa: F821

        f.__code__ = fast.__code__
    elif "code" in _SCALAR_PATCHED:
        f.__code__ = _SCALAR_PATCHED.pop("code")


def part_scalar(name, quick, dev, args, ctx):
    step = ctx.hand(name)
    xs, ys = ctx.batches(name)
    patch_scalar_conversion(True)
    try:
        for i in range(2):
            step(xs[i], ys[i])
        ms = 1000 * time_steps(step, xs, ys, args.steps)
        # exactness of the patch vs unpatched eager (same start, same batches)
        ex = None
        if torch.cuda.is_available():
            ex = exactness(step, xs, ys, lambda: None, step, args.exact_steps,
                           patched_then_unpatched=True)
    finally:
        patch_scalar_conversion(False)
    b = spec(name, quick)["batch"]
    return {"ms_per_step": ms, "samples_per_s": 1000 * b / ms, "exact_vs_eager": ex}


def exactness(eager_step, xs, ys, prepare, other_step, n, patched_then_unpatched=False):
    """Run n eager steps and n 'other' steps from the same state with TF32 off; diff."""
    snap = eager_step.snapshot()
    with tf32(False):
        if patched_then_unpatched:
            # other = patched (currently on); eager = unpatched
            for i in range(n):
                other_step(xs[i], ys[i])
            sync()
            w_other = [t.detach().clone() for t in eager_step.state()]
            eager_step.restore(snap)
            patch_scalar_conversion(False)
            for i in range(n):
                eager_step(xs[i], ys[i])
            sync()
            w_eager = [t.detach().clone() for t in eager_step.state()]
            patch_scalar_conversion(True)
        else:
            for i in range(n):
                eager_step(xs[i], ys[i])
            sync()
            w_eager = [t.detach().clone() for t in eager_step.state()]
            eager_step.restore(snap)
            prepare()
            for i in range(n):
                other_step(xs[i], ys[i])
            sync()
            w_other = [t.detach().clone() for t in eager_step.state()]
    eager_step.restore(snap)
    nw = len(eager_step.model.weights)
    d = rel_diff(w_other[:nw], w_eager[:nw])
    d["steps"] = n
    return d


class GraphedStep:
    """The whole hand step (zero_grad, forward, loss, backward, Keras Adam) in one
    CUDA graph. Inputs are copied into static buffers, then the graph is replayed."""

    def __init__(self, step, x0, y0, warmup=3):
        self.step = step
        self.sx = x0.clone()
        self.sy = y0.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                step(self.sx, self.sy)
        torch.cuda.current_stream().wait_stream(s)
        sync()
        step.model.zero_grad(set_to_none=True)
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            self.loss = step(self.sx, self.sy)

    def __call__(self, x, y):
        self.sx.copy_(x, non_blocking=True)
        self.sy.copy_(y, non_blocking=True)
        self.g.replay()
        return self.loss


def part_cudagraph(name, quick, dev, args, ctx):
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    step = ctx.hand(name)
    xs, ys = ctx.batches(name)
    res = {}
    snap = step.snapshot()
    # Keras turns python scalars and constant lists into CUDA tensors with a blocking copy
    # from pageable host memory (torch.as_tensor(..., device=cuda)), which capture refuses
    # ("Cannot copy between CPU and CUDA tensors during CUDA graph capture", first hit in
    # the loss: reduce_values' convert_to_tensor(ops.shape(values))). Patch it *before*
    # the warm-up: a capture that fails half-way leaves autograd nodes alive (held by the
    # exception) and a retry then fails with cudaErrorStreamCaptureImplicit.
    patch_scalar_conversion(True)
    res["scalar_patch"] = True
    t = time.perf_counter()
    try:
        g = GraphedStep(step, xs[0], ys[0])
    except Exception:
        patch_scalar_conversion(False)
        raise
    res["capture_s"] = time.perf_counter() - t
    ms = 1000 * time_steps(g, xs, ys, args.steps)
    b = spec(name, quick)["batch"]
    res.update({"ms_per_step": ms, "samples_per_s": 1000 * b / ms})
    # exactness: eager n steps vs replay n steps from the same state (TF32 off). The graph
    # was captured with TF32 on; re-capture with it off for the check.
    step.restore(snap)
    with tf32(False):
        w0 = step.snapshot()
        for i in range(args.exact_steps):
            step(xs[i], ys[i])
        sync()
        w_eager = [tt.detach().clone() for tt in step.state()]
        step.restore(w0)
        g2 = GraphedStep(step, xs[0], ys[0], warmup=2)
        step.restore(w0)
        for i in range(args.exact_steps):
            g2(xs[i], ys[i])
        sync()
        w_graph = [tt.detach().clone() for tt in step.state()]
    nw = len(step.model.weights)
    res["exact_vs_eager"] = rel_diff(w_graph[:nw], w_eager[:nw])
    res["exact_vs_eager"]["steps"] = args.exact_steps
    # the Keras optimizer's iteration counter advanced on the device inside the graph?
    res["opt_iterations_after"] = int(step.opt.iterations.value.item())
    step.restore(snap)
    del g, g2
    patch_scalar_conversion(False)
    return res


def part_compile(name, quick, dev, args, ctx, mode=None):
    """torch.compile(forward + loss); backward (AOT-compiled by the same compile) and
    the Keras optimizer run eagerly. TF32 is off for the whole part (dynamo guards on
    the TF32 flags, so flipping them for the exactness check would recompile); the
    eager hand loop is re-timed with TF32 off as the baseline."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base = ctx.hand(name)
    model = base.model
    xs, ys = ctx.batches(name)
    loss_fn = keras_loss()

    def fwd_loss(x, y):
        return loss_fn(y, model(x, training=True))

    b = spec(name, quick)["batch"]
    res = {"mode": mode or "default", "tf32": False}
    cfl = torch.compile(fwd_loss, mode=mode)
    cstep = HandStep.__new__(HandStep)
    cstep.__dict__.update(base.__dict__)
    cstep.forward_loss = cfl
    snap = base.snapshot()
    with tf32(False):
        eager_ms = 1000 * time_steps(base, xs, ys, max(3, args.steps // 2))
        res["eager_tf32_off_ms_per_step"] = eager_ms
        base.restore(snap)
        t = time.perf_counter()
        cstep(xs[0], ys[0])
        sync()
        res["first_call_s"] = time.perf_counter() - t
        t = time.perf_counter()
        cstep(xs[1], ys[1])
        sync()
        res["second_call_s"] = time.perf_counter() - t
        cstep(xs[2], ys[2])
        ms = 1000 * time_steps(cstep, xs, ys, args.steps)
        res.update({"ms_per_step": ms, "samples_per_s": 1000 * b / ms,
                    "speedup_vs_eager_tf32_off": eager_ms / ms})
        res.update(dynamo_stats())
        base.restore(snap)
        if torch.cuda.is_available() and args.exact_steps:
            res["exact_vs_eager"] = exactness(base, xs, ys, lambda: None, cstep,
                                              args.exact_steps)
    base.restore(snap)
    return res


def part_tv(name, quick, dev, args, ctx):
    import torchvision

    if not name.startswith("resnet50"):
        return {"skipped": "torchvision reference only for ResNet-50"}
    s = spec(name, quick)
    torch.manual_seed(0)
    m = torchvision.models.resnet50(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-7)
    lf = torch.nn.CrossEntropyLoss()
    g = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.rand(s["batch"], 3, s["size"], s["size"], generator=g).to(dev)
          .contiguous(memory_format=torch.channels_last) for _ in range(4)]
    ys = [torch.randint(0, 10, (s["batch"],), generator=g).to(dev) for _ in range(4)]
    m.train()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = lf(m(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(3):
        step(xs[i], ys[i])
    ms = 1000 * time_steps(step, xs, ys, args.steps)
    res = {"ms_per_step": ms, "samples_per_s": 1000 * s["batch"] / ms}
    # its launch count, for comparison with Keras's
    if torch.cuda.is_available():
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(xs[0], ys[0])
            sync()
        ev = prof.events()
        kern = [e for e in ev if e.device_type == DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset"))]
        res["kernels_per_step"] = len(kern)  # no record_function here: no annotations
        res["gpu_kernel_ms"] = sum(e.time_range.elapsed_us() for e in kern) / 1000
        res["gpu_kernel_ms"] = sum(t["self_dev_ms"] for t in table)  # kernels attributed to ops
    res["aten_ops_per_step"] = sum(1 for e in ev if e.device_type == DeviceType.CPU
                                       and e.name.startswith("aten::"))
    return res


# --------------------------------------------------------------------------- driver
class Ctx:
    def __init__(self, quick, dev, args):
        self.quick, self.dev, self.args = quick, dev, args
        self._hand, self._batches = {}, {}

    def hand(self, name):
        if name not in self._hand:
            self._hand[name] = HandStep(build(name, self.quick))
        return self._hand[name]

    def batches(self, name):
        if name not in self._batches:
            n = max(4, self.args.exact_steps)
            self._batches[name] = device_batches(name, self.quick, n, self.dev)
        return self._batches[name]


COSTS = {"fit": 25, "prof": 12, "pyprof": 6, "hand": 10, "scalar": 10, "cudagraph": 12,
         "compile": 90, "compile_ro": 90, "jitfit": 90, "tv": 15}


def run(args):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import keras

    RESULTS["meta"] = {
        "torch": torch.__version__, "keras": keras.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": sys.version.split()[0], "quick": args.quick,
        "tf32_default": [torch.backends.cuda.matmul.allow_tf32,
                         torch.backends.cudnn.allow_tf32],
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "steps": args.steps, "fit_steps": args.fit_steps,
    }
    ctx = Ctx(args.quick, dev, args)
    tasks = []
    for item in args.plan.split(","):
        m, p = item.split(":")
        m = {"r": "resnet50_64", "x": "xception_224"}.get(m, m)
        if m in args.models.split(",") and p in args.parts.split(","):
            tasks.append((m, p))
    for m, p in tasks:
        left = args.budget_s - (time.perf_counter() - T0)
        cost = COSTS.get(p, 20) * (0.2 if args.quick else 1)
        if left < min(cost, 30) and not args.quick:
            log(f"skip {m}:{p} ({left:.0f}s left)")
            record(m, p, {"skipped": f"budget ({left:.0f}s left)"})
            continue
        log(f"start {m}:{p}")
        t = time.perf_counter()
        try:
            limit = left - 5 if p in ("compile", "compile_ro", "jitfit") else left - 2
            if p in ("compile", "compile_ro", "jitfit"):
                limit = min(limit, args.compile_timeout_s)
            with alarm(None if args.quick else limit):
                if p == "fit":
                    r = part_fit(m, args.quick, dev, args)
                elif p == "jitfit":
                    r = part_fit(m, args.quick, dev, args, jit=True)
                elif p == "compile":
                    r = part_compile(m, args.quick, dev, args, ctx)
                elif p == "compile_ro":
                    r = part_compile(m, args.quick, dev, args, ctx, mode="reduce-overhead")
                else:
                    r = globals()[f"part_{p}"](m, args.quick, dev, args, ctx)
        except BaseException as e:  # noqa: BLE001 - a part must not end the run
            if isinstance(e, KeyboardInterrupt):
                raise
            r = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            traceback.print_exc()
            patch_scalar_conversion(False)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        r["part_s"] = time.perf_counter() - t
        record(m, p, r)
        log(f"done  {m}:{p} in {r['part_s']:.1f}s:",
            json.dumps({k: v for k, v in r.items()
                        if k not in ("top_self_cpu", "layout_ops", "top_tottime")},
                       default=str)[:1500])
        save(args.out)
    RESULTS["meta"]["total_s"] = time.perf_counter() - T0
    save(args.out)


def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def table(results):
    lines = []
    meta = results.get("meta", {})
    lines.append(f"# step_profile: {meta.get('device')} torch {meta.get('torch')} "
                 f"keras {meta.get('keras')}")
    for m, parts in results.get("runs", {}).items():
        lines.append(f"\n## {m}")
        lines.append("| variant | ms/step | samples/s | note |")
        lines.append("|---|---|---|---|")

        def row(label, p, note=""):
            r = parts.get(p)
            if r is None:
                return
            if "error" in r or "skipped" in r:
                lines.append(f"| {label} | - | - | {r.get('error') or r.get('skipped')} |"
                             .replace("\n", " "))
                return
            lines.append(f"| {label} | {fmt(r.get('ms_per_step'))} | "
                         f"{fmt(r.get('samples_per_s'), 0)} | {note(r) if callable(note) else note} |")

        row("(a) model.fit, eager", "fit", lambda r: f"first epoch {fmt(r['first_epoch_s'])} s")
        row("(c) model.fit, jit_compile=True", "jitfit",
            lambda r: (f"jit attr {r.get('jit_compile_attr')}; first epoch "
                       f"{fmt(r['first_epoch_s'])} s; graphs {r.get('unique_graphs')}, "
                       f"breaks {r.get('graph_breaks')}"))
        row("(d) hand loop, eager (data on GPU)", "hand",
            lambda r: (f"forward+loss alone {fmt(r.get('forward_loss_ms'))} ms; fit's batch "
                       f"slice+H2D {fmt(r.get('data_path', {}).get('ms_per_batch'))} ms"))
        row("(d') hand loop, sync-free scalars", "scalar",
            lambda r: _rel(r))
        row("(e) hand loop, torch.compile(fwd+loss)", "compile",
            lambda r: (f"TF32 off (eager TF32 off: {fmt(r.get('eager_tf32_off_ms_per_step'))} ms); "
                       f"first call {fmt(r['first_call_s'])} s; graphs {r.get('unique_graphs')}, "
                       f"breaks {r.get('graph_breaks')}; {_rel(r)}"))
        row("(e) hand loop, torch.compile reduce-overhead", "compile_ro",
            lambda r: (f"first call {fmt(r['first_call_s'])} s; graphs {r.get('unique_graphs')}, "
                       f"breaks {r.get('graph_breaks')}; {_rel(r)}"))
        row("(e) whole step in one CUDA graph", "cudagraph",
            lambda r: (f"capture {fmt(r['capture_s'])} s"
                       f"{'; needed scalar patch' if r.get('scalar_patch') else ''}; {_rel(r)}"))
        row("(f) torchvision resnet50 channels_last", "tv",
            lambda r: (f"{r.get('kernels_per_step')} kernels/step, GPU kernel "
                       f"{fmt(r.get('gpu_kernel_ms'))} ms"))
        for pp in ("compile", "jitfit", "compile_ro"):
            r = parts.get(pp)
            if r and r.get("top_break_reasons"):
                lines.append(f"\n{pp}: graph-break reasons (count):")
                for k, n in r["top_break_reasons"][:5]:
                    lines.append(f"- {n} x {k.splitlines()[0][:90]}: "
                                 f"{' '.join(k.split())[90:260]}")
        p = parts.get("prof")
        if p and "error" not in p and "skipped" not in p:
            lines.append("\n(b) profile of one eager hand step (per step, profiler on):")
            lines.append("| region | wall ms | in torch ops ms | Keras/Python ms | top-level ops |")
            lines.append("|---|---|---|---|---|")
            for reg in ("k_forward", "k_backward", "k_optimizer", "k_other"):
                r = p["regions"].get(reg)
                if r:
                    lines.append(f"| {reg[2:]} | {fmt(r['wall_ms'])} | {fmt(r['ops_ms'])} | "
                                 f"{fmt(r['python_ms'])} | {fmt(r['ops'], 0)} |")
            lines.append(
                f"\nstep wall {fmt(p['step_wall_ms'])} ms; autograd-thread op time "
                f"{fmt(p['autograd_thread_ops_ms'])} ms; CUDA kernel time "
                f"{fmt(p['gpu_kernel_ms'])} ms ({fmt(p['kernels'], 0)} kernels); "
                f"aten ops {fmt(p['aten_ops_per_step'], 0)}; cudaLaunchKernel "
                f"{fmt(p['cudaLaunchKernel'], 0)}; stream syncs {fmt(p['stream_syncs'], 0)}; "
                f"H2D memcpys {fmt(p['memcpy_htod'], 0)}; layout-copy kernel time "
                f"{fmt(p['layout_copy_dev_ms'])} ms")
            lines.append("\n| layout op | calls/step | self CPU ms | self CUDA ms |")
            lines.append("|---|---|---|---|")
            for t in sorted(p["layout_ops"], key=lambda t: -t["self_cpu_ms"]):
                lines.append(f"| {t['name']} | {fmt(t['count'], 0)} | {fmt(t['self_cpu_ms'], 2)} | "
                             f"{fmt(t['self_dev_ms'], 2)} |")
            lines.append("\n| top op by self CPU | calls/step | self CPU ms | self CUDA ms |")
            lines.append("|---|---|---|---|")
            for t in p["top_self_cpu"][:12]:
                lines.append(f"| {t['name'][:60]} | {fmt(t['count'], 0)} | "
                             f"{fmt(t['self_cpu_ms'], 2)} | {fmt(t['self_dev_ms'], 2)} |")
        q = parts.get("pyprof")
        if q and "top_tottime" in q:
            lines.append(f"\ncProfile of one hand step (profiled total {fmt(q['total_s_profiled'], 3)} s),"
                         " top Python functions by own time:")
            lines.append("| function | calls | own ms |")
            lines.append("|---|---|---|")
            for f, n, t in q["top_tottime"][:12]:
                lines.append(f"| {f} | {n} | {t} |")
    return "\n".join(lines)


def _rel(r):
    e = r.get("exact_vs_eager")
    if not e:
        return "no exactness check"
    if "max_tensor_rel" not in e:
        return f"exactness: {e}"
    return (f"after {e.get('steps')} steps, TF32 off: global rel diff {e['global_rel']:.1e}, "
            f"worst tensor {e['max_tensor_rel']:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet50_64,xception_224")
    ap.add_argument("--parts", default="fit,prof,pyprof,hand,scalar,cudagraph,tv,compile,jitfit")
    ap.add_argument("--plan", default=(
        # timings before any profiler: after torch.profiler has run once, CUPTI stays
        # attached and eager launches get slower
        "r:hand,r:cudagraph,r:fit,r:scalar,r:tv,x:hand,x:cudagraph,x:fit,x:scalar,"
        "r:compile,r:jitfit,r:prof,r:pyprof,x:prof,x:pyprof,x:compile,r:compile_ro,x:jitfit"),
        help="order of model:part tasks (r=resnet50_64, x=xception_224)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--fit-steps", type=int, default=10, help="steps per fit epoch")
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--exact-steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=470)
    ap.add_argument("--compile-timeout-s", type=float, default=150)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", action="store_true", help="also write chrome traces")
    ap.add_argument("--table", default=None, help="print the table of a results.json")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    try:
        run(args)
    finally:
        save(args.out)
        text = table(RESULTS)
        print("\n" + text, flush=True)
        if args.out:
            with open(os.path.join(args.out, "table.md"), "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()

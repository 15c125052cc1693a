"""kmgpu's captured torch step with and without ``fast_layers``' Dense (F.linear) and sparse
cross-entropy (contiguous (rows, classes) view), ``fast_conv``'s convolution inputs and
``fast_rnn``'s masked GRU and ``fast_einsum``'s EinsumDense (F.linear). A script that prints Markdown tables, not a test.

    KERAS_BACKEND=torch python benchmarks/lab/torch_fast_ops.py [--quick]
        [--models transformer,bert,resnet50,gru] [--steps 10] [--top 12] [--out FILE.md]
        [--order both,all,all,both] [--parity-models resnet50]

Per model (torch_kernels.py's: the bench's transformer batch 64, the BERT-style encoder
batch 64, ResNet-50 64x64 batch 256), in one process, kmgpu's default captured step
(``graphs.local_step``, TF32 matmuls, fused BatchNorm, flat optimizer) on a fresh model
from the same initial weights per run, the variants switched by their environment
variables (``KMGPU_TORCH_FAST_LOSS``, ``KMGPU_TORCH_FAST_DENSE``, ``KMGPU_TORCH_FAST_CONV``,
``KMGPU_TORCH_FAST_RNN``, ``KMGPU_TORCH_FAST_EINSUM``: read as the step's swap opens) in an
order-balanced sequence:

keras   Keras's Dense, EinsumDense, loss and convolution inputs
loss    the sparse cross-entropy only          dense   Dense only
both    Dense and the loss (kmgpu's default before fast_conv)
noeinsum  all on but ``fast_einsum`` (kmgpu's default before it)
all     all on (kmgpu's default)
loop    all on but ``fast_rnn`` (``KMGPU_TORCH_FAST_RNN=0``: Keras's masked GRU loop)

transformer: keras, both, loss, dense, dense, loss, both, keras; the others (their loss has
rank 2: only Dense can change) keras, both, both, keras; gru (the masked bidirectional GRU
of backends_balanced.py) loop, all, all, loop; ``--order`` sets one sequence for
every model (its first two variants are profiled and compared). ms per step: 3 blocks of
``--steps`` replays each (wall, CUDA synchronised), per run; samples/s from the median.
Then, for the first two variants, the eager split step (the kernels the graphs record) under
``torch.profiler``: kernels / GPU ms per category (torch_kernels.py's categories) and the
``--top`` kernels by GPU time; for the ``--parity-models`` (the transformer and gru),
``--parity-steps`` steps of the first variant, the second and the first again from the same
weights with TF32 off, under Adam and under SGD with momentum: the weights and loss against
the first's (Adam turns the zero-up-to-rounding gradient
of the attention's key bias into lr-sized steps; SGD does not). ``--parity-only``: that
comparison alone; ``--float64``: each of the two also against Keras's own eager steps of the
model in float64. gru: also a 2-epoch ``kmgpu.parallelize(model, gpus=1).fit`` of 10
steps an epoch: what kmgpu printed (a capture that falls back says so) and its
``describe()``. On a CPU (``--quick``) the swaps are not installed (CUDA only)
and the figures are CPU times: a smoke test of the script.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "lab"))
os.environ.setdefault("KERAS_BACKEND", "torch")

import torch_kernels as tk  # noqa: E402 (the models and batches)
import torch_profile as tp  # noqa: E402 (the categories, profiling and timing)

SWITCHES = ("KMGPU_TORCH_FAST_LOSS", "KMGPU_TORCH_FAST_DENSE", "KMGPU_TORCH_FAST_CONV",
            "KMGPU_TORCH_FAST_RNN", "KMGPU_TORCH_FAST_EINSUM")
VARIANTS = {"keras": "00010", "loss": "10010", "dense": "01010", "both": "11010",
            "noeinsum": "11110", "all": "11111",
            "loop": "11101"}  # each switch's value, in SWITCHES' order
ORDER = {"transformer": ("keras", "both", "loss", "dense", "dense", "loss", "both", "keras"),
         "gru": ("loop", "all", "all", "loop")}
ORDER_OTHERS = ("keras", "both", "both", "keras")
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def switch(variant):
    for name, on in zip(SWITCHES, VARIANTS[variant]):
        os.environ[name] = on


def profile(fn, steps, gpu, top):
    """(per category {name: [kernels, ms]} per step, top kernels [(name, n, ms)] per step)."""
    import torch

    table = {c: [0, 0.0] for c in tp.CATEGORIES}
    names = collections.defaultdict(lambda: [0, 0.0])
    for e in tp.recorded(fn, steps, gpu):
        if gpu and e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        chain = tp._chain(e)
        if gpu:
            kernels = [(k.name, k.duration) for k in e.kernels]
        elif not e.cpu_children and not e.name.startswith(("kmgpu::", "autograd::")):
            kernels = [(e.name, e.self_cpu_time_total)]
        else:
            kernels = []
        for name, us in kernels:
            c = tp.categorise(name, chain, False)
            table[c][0] += 1
            table[c][1] += us
            key = f"{c}: {chain[0] if chain else '?'} -> {name[:70]}"
            names[key][0] += 1
            names[key][1] += us
    per = {c: [n / steps, us / steps / 1e3] for c, (n, us) in table.items()}
    tops = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return per, [(k, n / steps, us / steps / 1e3) for k, (n, us) in tops]


def run_model(name, quick, steps, top, parity_steps=0, parity_only=False, order=None,
              float64=False):
    import torch

    from kmgpu.engines.torch import capture_fixes, cond_fixes, fast_fixes, precision
    from kmgpu.engines.torch.capture import graphs

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    xn, yn = tk.batch_arrays(name, quick)
    x, y = torch.as_tensor(xn, device=dev), torch.as_tensor(yn, device=dev)
    n = int(x.shape[0])
    init, runs, profiles = None, [], {}
    order = order or ORDER.get(name, ORDER_OTHERS)
    pair = list(dict.fromkeys(order))[:2]
    for variant in () if parity_only else order:
        switch(variant)
        model = tk.compiled(name, quick)
        model(x[:1])
        init = init or model.get_weights()
        model.set_weights(init)
        step = graphs.local_step(model, tf32=True)
        for _ in range(graphs.WARMUP_STEPS + 2):
            step.train_step((x, y))
        r = {"variant": variant, "captured": bool(step.graphs) and step.reason is None,
             "ms": tp.blocks(lambda: step.train_step((x, y)), steps, gpu)}
        runs.append(r)
        log(name, json.dumps(r))
        step.close()
        if variant in pair and variant not in profiles:
            split = graphs.SplitStep(model)

            def eager():
                with capture_fixes.device_scalars(), capture_fixes.device_random(), \
                        precision.matmul_precision(True), fast_fixes.fused_batchnorm(dev), \
                        fast_fixes.fast_ops(dev), cond_fixes.step_conditions(model):
                    split.layout()
                    return split.step(x, y, None, n, n)

            for _ in range(2):
                eager()
            profiles[variant] = profile(eager, 2, gpu, top)
            log(name, variant, json.dumps(profiles[variant][0]))
    out = {"desc": tk.spec(name, quick)[0], "batch": n, "runs": runs, "profiles": profiles}
    if parity_steps:
        if init is None:
            model = tk.compiled(name, quick)
            model(x[:1])
            init = model.get_weights()
        out["parity"] = parity(name, quick, init, x, y, parity_steps, pair, float64)
        log(name, "parity", json.dumps(out["parity"]))
    if name == "gru" and not parity_only:
        out["fit"] = fit_check(name, quick)
        log(name, "fit", json.dumps(out["fit"]))
    return out


def fit_check(name, quick):
    """A 2-epoch kmgpu fit (default switches) of 10 steps an epoch: what kmgpu printed,
    its describe(), seconds per epoch."""
    import contextlib
    import io
    import warnings

    import numpy as np

    import kmgpu

    switch("all")
    xn, yn = tk.batch_arrays(name, quick)
    x, y = np.concatenate([xn] * 10), np.concatenate([yn] * 10)
    model = tk.compiled(name, quick)
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as warned, contextlib.redirect_stdout(printed), \
            contextlib.redirect_stderr(printed):
        warnings.simplefilter("always")
        parallel = kmgpu.parallelize(model, gpus=1)
        seconds = []
        for _ in range(2):
            t = time.perf_counter()
            parallel.fit(x, y, batch_size=len(xn), epochs=1, shuffle=False, verbose=0)
            seconds.append(time.perf_counter() - t)
    lines = [ln for ln in printed.getvalue().splitlines() if "kmgpu" in ln]
    lines += [str(w.message) for w in warned if "kmgpu" in str(w.message)]
    return {"printed": lines, "describe": parallel.describe(), "epoch_s": seconds}


def parity(name, quick, init, x, y, steps, pair=("keras", "both"), float64=False):
    """``pair``'s second against its first (and the first against itself), ``steps``
    captured steps each from
    ``init`` with TF32 off, under Adam and under SGD with momentum: the largest relative
    difference of the weights (per tensor, floor 1e-3; with the variable) and of the loss
    after the last step. ``float64``: also each one's weights against Keras's own eager
    steps (``train_on_batch``, no kmgpu) of the model in float64 from the same weights."""
    import numpy as np
    import torch

    from kmgpu.engines.torch.capture import graphs

    b = torch.backends
    saved = b.cudnn.deterministic, b.cudnn.benchmark
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    got = {}
    try:
        for sgd in (False, True):
            for label, variant in (("ref", pair[0]), ("new", pair[1]), ("ref again", pair[0])):
                switch(variant)
                model = tk.compiled(name, quick, sgd)
                model(x[:1])
                model.set_weights(init)
                step = graphs.local_step(model, tf32=False)
                for _ in range(steps):
                    logs = step.train_step((x, y))
                got[label, sgd] = ([w.path for w in model.weights], model.get_weights(),
                                   float(logs["loss"]))
                step.close()
            if float64:
                got["float64", sgd] = float64_run(name, quick, init, x, y, steps, sgd)
    finally:
        b.cudnn.deterministic, b.cudnn.benchmark = saved
        switch("all")

    def worst(u, v, paths):
        return max((float(np.max(np.abs(np.float64(a) - b)) / max(np.max(np.abs(a)), 1e-3)), p)
                   for a, b, p in zip(u, v, paths))

    out = {"steps": steps, "reference": pair[0]}
    names = {"new": pair[1], "ref again": f"{pair[0]} again"}
    for sgd in (False, True):
        paths, ref_w, ref_loss = got["ref", sgd]
        opt = "SGD" if sgd else "Adam"
        out[f"loss {pair[0]}, {opt}"] = ref_loss
        for label in ("new", "ref again"):
            d, where = worst(ref_w, got[label, sgd][1], paths)
            out[f"{names[label]}, {opt}: weights, loss"] = [
                d, abs(got[label, sgd][2] - ref_loss) / abs(ref_loss), where]
        if float64:
            for label in ("ref", "new"):
                d, where = worst(got["float64", sgd], got[label, sgd][1], paths)
                out[f"{pair[0] if label == 'ref' else pair[1]} vs float64, {opt}"] = [d, where]
    return out


def float64_run(name, quick, init, x, y, steps, sgd):
    """The weights after ``steps`` of Keras's own eager ``train_on_batch`` (no kmgpu) of the
    model built in float64 from ``init``."""
    import keras
    import numpy as np

    keras.config.set_floatx("float64")
    try:
        model = tk.compiled(name, quick, sgd)
        model(x[:1])
        model.set_weights([np.float64(w) if np.asarray(w).dtype.kind == "f" else w
                           for w in init])
        xs = x.double() if x.is_floating_point() else x
        for _ in range(steps):
            model.train_on_batch(xs, y)
        return model.get_weights()
    finally:
        keras.config.set_floatx("float32")


def markdown(results, gpu):
    unit = "GPU" if gpu else "CPU (smoke test)"
    lines = ["| model | variant | runs (captured) | ms/step, 3 blocks per run | samples/s "
             "(median; min-max over blocks) |", "|---|---|---|---|---|"]
    for r in results.values():
        by = collections.defaultdict(list)
        for run in r["runs"]:
            by[run["variant"]].append(run)
        for variant in VARIANTS:
            rs = by.get(variant)
            if not rs:
                continue
            ms = [m for run in rs for m in run["ms"]]
            rate = [r["batch"] / m * 1e3 for m in ms]
            lines.append(
                f"| {r['desc']} | {variant} | {len(rs)} ({sum(x['captured'] for x in rs)}) | "
                + "; ".join(", ".join(f"{m:.2f}" for m in run["ms"]) for run in rs)
                + f" | {r['batch'] / statistics.median(ms) * 1e3:,.0f} "
                f"({min(rate):,.0f}-{max(rate):,.0f}) |")
    lines += ["", f"Eager split step, {unit} kernels / ms per step by category:", "",
              "| model | variant | total | " + " | ".join(tp.CATEGORIES) + " |",
              "|---" * (len(tp.CATEGORIES) + 3) + "|"]
    for r in results.values():
        for variant, (per, _) in r["profiles"].items():
            total = (sum(v[0] for v in per.values()), sum(v[1] for v in per.values()))
            lines.append(f"| {r['desc']} | {variant} | {total[0]:.0f} / {total[1]:.2f} | "
                         + " | ".join(f"{per[c][0]:.0f} / {per[c][1]:.2f}"
                                      for c in tp.CATEGORIES) + " |")
    for r in results.values():
        if "parity" in r:
            p = r["parity"]
            lines += ["", f"{r['desc']}: {p['steps']} captured steps from the same weights, TF32 "
                      "off, against the first variant: max relative difference of the weights "
                      "(per tensor, floor 1e-3; where) and of the last loss: "
                      + "; ".join(f"{k[:-len(': weights, loss')]} {v[0]:.1e} ({v[2]}), {v[1]:.1e}"
                                  for k, v in p.items() if k.endswith("weights, loss"))]
            far = {k: v for k, v in p.items() if " vs float64, " in k}
            if far:
                lines += ["", f"{r['desc']}: the same steps against Keras's own eager steps of "
                          "the model in float64 (train_on_batch, same weights): "
                          + "; ".join(f"{k} {v[0]:.1e} ({v[1]})" for k, v in far.items())]
    for r in results.values():
        if "fit" in r:
            f = r["fit"]
            lines += ["", f"{r['desc']}: kmgpu.parallelize(model, gpus=1).fit, 2 epochs of 10 "
                      f"steps: {', '.join(f'{s:.2f}' for s in f['epoch_s'])} s; kmgpu printed: "
                      f"{f['printed'] or 'nothing'}; describe(): {f['describe']}"]
    for r in results.values():
        for variant, (_, tops) in r["profiles"].items():
            lines += ["", f"Top kernels, {r['desc']}, {variant} (category: launching op -> "
                      "kernel; per step):", "", "| kernel | n | ms |", "|---|---|---|"]
            lines += [f"| `{k}` | {n:.0f} | {ms:.3f} |" for k, n, ms in tops]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="transformer,bert,resnet50")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--parity-steps", type=int, default=5,
                   help="--parity-models: the order's first two variants with TF32 off, this many steps")
    p.add_argument("--parity-only", action="store_true", help="only the weight comparison")
    p.add_argument("--parity-models", default="transformer,gru")
    p.add_argument("--float64", action="store_true",
                   help="parity: also each variant against Keras's own steps in float64")
    p.add_argument("--order", help="variants in order, for every model (e.g. both,all,all,both)")
    p.add_argument("--out")
    a = p.parse_args()
    import torch

    results = {}
    for name in [m for m in a.models.split(",") if m]:
        log(f"model {name}")
        results[name] = run_model(name, a.quick, a.steps, a.top,
                                  a.parity_steps if name in a.parity_models.split(",") else 0,
                                  a.parity_only, a.order and a.order.split(","), a.float64)
        text = markdown(results, torch.cuda.is_available())
        if a.out:  # after each model: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                f.write(text + "\n")
            with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
                json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()

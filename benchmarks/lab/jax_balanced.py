"""Plain Keras against kmgpu on JAX, order-balanced. A script that prints a
Markdown table, not a test.

    KERAS_BACKEND=jax python benchmarks/lab/jax_balanced.py [--quick] [--devices N]
        [--models resnet50_small,...] [--variants plain,kmgpu] [--rounds 2]
        [--processes P] [--budget SECONDS] [--out DIR]

``--processes P``: one process per run. P times, a process for each variant in turn
(plain, kmgpu, plain, kmgpu, ... for P = 2), each running only its variant over every
model: the warm-up, then per model its first fit (the first compile of that
architecture in that process: a fair first epoch) and ``--rounds`` rounds of the
measures below. Each measure pools the processes' figures (first: one per process).

Without it, one process. A tiny warm-up fit first (the first fit of a process pays JAX's and the
GPU's start-up; it is charged to no variant). Per model, one instance per variant, the
same initial weights and data:

    first      the first ``fit(epochs=1)`` (compiles the train step), then an untimed
               evaluate and predict (compile those); variants in an order that rotates
               from model to model (each variant goes first equally often)
    rounds     ``--rounds`` times, the variants in turn, the order reversed every other
               round (A B B A ...): a ``fit(epochs=1)`` (steady epoch), a ``fit(epochs=1,
               validation_data=...)`` (epoch with validation), ``evaluate``, ``predict``
               (``--eval-rows`` rows, the fit's batch)

Figures: seconds, the median over rounds, the spread (min-max) beside it; "x" = plain's
time / the variant's time (above 1: faster than plain).

Variants: ``plain`` the model's own fit; ``kmgpu`` ``kmgpu.parallelize(model,
gpus=N)`` as the code stands; ``keras`` the same with KMGPU_JAX_FAST=0 where the code
still has that switch; ``packed`` (after ``keras``) KMGPU_JAX_FAST=packed through a second
``parallelize`` of the ``keras`` variant's model: it compiles only its own train step, and
is timed on fit only (evaluate and predict do not use it). ``--devices N`` simulates N CPU devices
(set before JAX starts) and gives kmgpu N of them; ``--models mlp_deep`` (``mlp_deepD``: D
hidden layers, default 60) is a model of many small arrays and little arithmetic (host
time per step: what the former packed step took out).
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("KERAS_BACKEND", "jax")

MODELS = ("resnet50_small", "resnet50_small@128", "efficientnetb0", "transformer", "lstm",
          "bert", "gru")
MEASURES = ("first", "steady", "validation", "evaluate", "predict")


def workload(name, quick):
    """(Workload, build function) for ``name`` (``@B``: another batch)."""
    from kmgpu.bench import workloads

    name, _, batch = name.partition("@")
    if name == "efficientnetb0":
        base = workloads.get("resnet50", quick)
        w = dataclasses.replace(
            base, name=name, batch=base.batch if quick else 64, steps=base.steps if quick else 10,
            builder=base.builder if quick else "application",
            args=base.args if quick else (("classes", 1000), ("image", 224),
                                          ("name", "EfficientNetB0")),
            input_shape=base.input_shape if quick else (224, 224, 3),
            classes=base.classes if quick else 1000)
    elif name == "bert" or name.startswith("mlp_deep"):
        w = dataclasses.replace(workloads.get("transformer", quick), name=name)
    elif name == "gru":  # the masked bidirectional GRU, batch 128
        w = dataclasses.replace(workloads.get("transformer", quick), name=name,
                                batch=16 if quick else 128, steps=2 if quick else 10,
                                input_shape=(16 if quick else 128,))
        if name.startswith("mlp_deep"):
            w = dataclasses.replace(w, batch=64, steps=20, loss="mse", input_shape=(16,))
    else:
        w = workloads.get(name, quick)
        if not quick:
            w = dataclasses.replace(w, steps=min(w.steps, 20))
    if batch:
        w = dataclasses.replace(w, batch=int(batch), steps=w.steps * w.batch // int(batch))
    return w, (lambda: build(w, quick))


def build(w, quick):
    import keras

    from kmgpu.bench import workloads

    keras.utils.set_random_seed(workloads.SEED)
    if w.name == "bert":  # BERT-style encoder: bidirectional attention, a class per sequence
        L = keras.layers
        d, heads, ffn, blocks = (32, 2, 64, 2) if quick else (512, 8, 2048, 4)
        tokens = keras.Input(w.input_shape, dtype="int32")
        h = L.Embedding(w.classes, d)(tokens)
        h = L.EinsumDense("btd,de->bte", output_shape=(w.input_shape[0], d), bias_axes="te")(h)
        h = L.LayerNormalization(epsilon=1e-12)(h)
        for _ in range(blocks):
            h = L.LayerNormalization(epsilon=1e-12)(h + L.MultiHeadAttention(
                heads, key_dim=d // heads)(h, h))
            h = L.LayerNormalization(epsilon=1e-12)(
                h + L.Dense(d)(L.Dense(ffn, activation="gelu")(h)))
        out = L.Dense(2)(L.Dense(d, activation="tanh")(h[:, 0]))
        return keras.Model(tokens, out, name="bert")
    if w.name == "gru":  # padded token sequences: Embedding(mask_zero) -> Bidirectional(GRU)
        L = keras.layers
        width = 16 if quick else 128
        tokens = keras.Input(w.input_shape, dtype="int32")
        h = L.Embedding(w.classes, width, mask_zero=True)(tokens)
        h = L.Bidirectional(L.GRU(width))(h)
        return keras.Model(tokens, L.Dense(2)(h), name="gru")
    if w.name.startswith("mlp_deep"):  # many small arrays, little arithmetic: host-bound
        depth = int(w.name[len("mlp_deep"):] or 60)  # mlp_deep20: 20 hidden layers
        layers = [keras.Input(w.input_shape)]
        layers += [keras.layers.Dense(16, activation="relu") for _ in range(depth)]
        return keras.Sequential(layers + [keras.layers.Dense(1)], name="mlp_deep")
    return w.build()


def data(w):
    import numpy as np

    if w.name in ("bert", "gru"):
        x, _ = dataclasses.replace(w, name="transformer").data()
        if w.name == "gru":  # zero padding after a length between a quarter and all of it
            seq = x.shape[1]
            lengths = np.random.default_rng(1).integers(seq // 4, seq + 1, size=len(x))
            x = np.where(np.arange(seq)[None] < lengths[:, None], np.maximum(x, 1), 0)
            x = x.astype("int32")
        return x, (x[:, 0] % 2).astype("int32")
    if w.name.startswith("mlp_deep"):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((w.samples(), 16), dtype=np.float32)
        return x, x[:, :1] * 0.5
    return w.data()


class Runner:
    def __init__(self, variant, w, builder, devices, share=None):
        import kmgpu

        self.variant, self.target, self.shared = variant, None, share is not None
        if share is not None:  # the packed step over the kmgpu variant's model
            self.model = share
        else:
            self.model = builder()
            self.model.compile(**w.compile_args())
        self.target = self.model
        self.shared = share is not None
        if variant != "plain":
            import warnings

            with self._env(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.target = kmgpu.parallelize(self.model, gpus=devices)
        self.shared = share is not None

    def _env(self):
        import contextlib

        value = {"keras": "0", "packed": "packed"}.get(self.variant)

        @contextlib.contextmanager
        def env():
            old = os.environ.get("KMGPU_JAX_FAST")
            if value is not None:
                os.environ["KMGPU_JAX_FAST"] = value
            try:
                yield
            finally:
                if value is not None:
                    if old is None:
                        os.environ.pop("KMGPU_JAX_FAST", None)
                    else:
                        os.environ["KMGPU_JAX_FAST"] = old

        return env()

    def timed(self, method, *args, **kwargs):
        import warnings

        with self._env(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kmgpu's few-steps note
            start = time.perf_counter()
            getattr(self.target, method)(*args, **kwargs)
            if method == "fit":
                sync(self.model)
            return time.perf_counter() - start


def sync(model):
    """Wait for the device's work on ``model``'s variables (JAX and torch run ahead)."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.variables])
    elif keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def device_name():
    """'<device kind> x<count>' of the backend this process runs."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        return "cpu x1"
    import jax

    return f"{jax.devices()[0].device_kind} x{len(jax.devices())}"


def run_model(name, variants, args, index):
    w, builder = workload(name, args.quick)
    if args.steps:
        w = dataclasses.replace(w, steps=args.steps)
    x, y = data(w)
    rows = min(len(x), args.eval_rows) // w.batch * w.batch or w.batch
    xv, yv = x[:rows], y[:rows]
    fit = dict(batch_size=w.batch, epochs=1, shuffle=False, verbose=0)
    runners = {}
    for v in variants:
        share = runners.get("keras") if v == "packed" else None
        runners[v] = Runner(v, w, builder, args.devices, share and share.model)
    times = {v: {m: [] for m in MEASURES} for v in variants}
    k = index % len(variants)
    for v in variants[k:] + variants[:k]:  # who compiles first rotates over the models
        r = runners[v]
        times[v]["first"].append(r.timed("fit", x, y, **fit))
        if not r.shared and not args.fit_only:
            r.timed("evaluate", xv, yv, batch_size=w.batch, verbose=0)
            r.timed("predict", xv, batch_size=w.batch, verbose=0)
    for i in range(args.rounds):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            r, t = runners[v], times[v]
            t["steady"].append(r.timed("fit", x, y, **fit))
            if args.fit_only:
                continue
            t["validation"].append(r.timed("fit", x, y, validation_data=(xv, yv), **fit))
            if not r.shared:  # the packed step changes fit only
                t["evaluate"].append(r.timed("evaluate", xv, yv, batch_size=w.batch,
                                             verbose=0))
                t["predict"].append(r.timed("predict", xv, batch_size=w.batch, verbose=0))
    from kmgpu import checks

    scan = []
    for _ in range(3):  # kmgpu's NaN/inf scan of the evaluate rows (x), alone
        t0 = time.perf_counter()
        checks._finite("x", xv)
        scan.append(time.perf_counter() - t0)
    mode = None
    for v in ("kmgpu", "packed"):
        if v in runners:
            mode = runners[v].target._engine.train_step_mode(runners[v].model)
    return dict(model=name, batch=w.batch, train_rows=len(x), eval_rows=rows,
                devices=args.devices, times=times, kmgpu_step=mode, scan_s=min(scan))


def run_processes(args, variants, argv):
    """--processes: one child process per run (P x the variants, in turn); their figures
    pooled per model, variant and measure. Returns the results as ``run_model`` gives."""
    pooled, order = {}, []
    share = args.budget / (args.processes * len(variants)) if args.budget else 0.0
    keep = []  # the options a child takes as they are
    skip = {"--processes", "--variants", "--budget", "--out"}
    it = iter(argv)
    for a in it:
        name = a.split("=")[0]
        if name in skip:
            if "=" not in a:
                next(it, None)
            continue
        keep.append(a)
    for p in range(args.processes):
        for v in variants:
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.abspath(__file__), *keep, "--variants", v,
                   "--budget", str(share), "--child"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = [json.loads(line[len("JAXBAL "):]) for line in proc.stdout.splitlines()
                   if line.startswith("JAXBAL ")]
            print(f"process {p + 1}/{args.processes} {v}: {time.perf_counter() - t0:.0f} s, "
                  f"{len(got)} model(s)" + ("" if proc.returncode == 0 else
                                            f", exit {proc.returncode}:\n"
                                            + (proc.stdout + proc.stderr)[-3000:]),
                  flush=True)
            for line in proc.stdout.splitlines():
                if line.startswith("skipped") or (line.startswith("# jax_balanced") and p == 0):
                    print(f"  {line}", flush=True)
            for r in got:
                if r["model"] not in pooled:
                    order.append(r["model"])
                    pooled[r["model"]] = dict(r, times={u: {m: [] for m in MEASURES}
                                                        for u in variants})
                into = pooled[r["model"]]
                for m in MEASURES:
                    into["times"][v][m] += r["times"][v][m]
                if r.get("kmgpu_step"):
                    into["kmgpu_step"] = r["kmgpu_step"]
            if args.out:  # what is in so far, should a later process not finish
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "jax_balanced.json"), "w") as f:
                    json.dump(dict(variants=variants, processes=args.processes,
                                   results=[pooled[m] for m in order]), f, indent=1)
    return [pooled[m] for m in order]


def fmt(values):
    if not values:
        return "-"
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:.3f}"
    return f"{m:.3f} [{min(values):.3f}-{max(values):.3f}]"


def table(results, variants):
    base = variants[0]
    lines = ["| model | B | measure | " + " | ".join(variants) + " | "
             + " | ".join(f"{v} x" for v in variants[1:]) + " |",
             "|---|---|---|" + "---|" * (2 * len(variants) - 1)]
    for r in results:
        for m in MEASURES:
            t = r["times"]
            cells = [fmt(t[v][m]) for v in variants]
            ratios = []
            for v in variants[1:]:
                if t[v][m] and t[base][m]:
                    ratios.append(f"{statistics.median(t[base][m]) / statistics.median(t[v][m]):.2f}x")
                else:
                    ratios.append("-")
            lines.append(f"| {r['model']} | {r['batch']} | {m} | " + " | ".join(cells)
                         + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def warm_up():
    import keras
    import numpy as np

    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    m.compile(optimizer="adam", loss="mse")
    x = np.ones((64, 8), "float32")
    m.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0)
    m.evaluate(x, x[:, :1], verbose=0)
    m.predict(x, verbose=0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU sizes")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default="plain,kmgpu")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval-rows", type=int, default=4096)
    p.add_argument("--steps", type=int, default=0, help="steps per epoch (0: the model's)")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds: start no new model after this (0: no limit)")
    p.add_argument("--processes", type=int, default=0,
                   help="one process per run: P rounds of a process per variant (0: one "
                        "process for everything)")
    p.add_argument("--fit-only", action="store_true",
                   help="time the first and steady epochs only (no validation, evaluate, "
                        "predict)")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if args.processes:
        start = time.perf_counter()
        results = run_processes(args, variants, sys.argv[1:] if argv is None else argv)
        text = table(results, variants)
        print(f"# jax_balanced: one process per run, {args.processes} per variant "
              f"({', '.join(variants)} in turn), rounds {args.rounds} per process\n\n{text}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "jax_balanced.json"), "w") as f:
                json.dump(dict(variants=variants, results=results, processes=args.processes),
                          f, indent=1)
        print(f"total {time.perf_counter() - start:.0f} s")
        return
    if args.devices > 1:
        import kmgpu

        kmgpu.simulate_devices(args.devices)
    import keras

    start, results = time.perf_counter(), []
    warm_up()
    print(f"# jax_balanced ({keras.backend.backend()}): {device_name()}, "
          f"kmgpu on {args.devices} device(s), rounds {args.rounds}", flush=True)
    for i, name in enumerate(args.models.split(",")):
        if args.budget and time.perf_counter() - start > args.budget:
            print(f"skipped {name}: past --budget {args.budget:.0f} s", flush=True)
            continue
        t0 = time.perf_counter()
        results.append(run_model(name, variants, args, i))
        if args.child:
            print("JAXBAL " + json.dumps(results[-1]), flush=True)
            continue
        print(table(results[-1:], variants), flush=True)
        print(f"({name}: {time.perf_counter() - t0:.0f} s; kmgpu step: "
              f"{results[-1]['kmgpu_step']}; NaN/inf scan of the evaluate x: "
              f"{1e3 * results[-1]['scan_s']:.1f} ms)", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "jax_balanced.json"), "w") as f:
                json.dump(dict(variants=variants, results=results,
                               device=device_name()), f, indent=1)
    print("\n" + table(results, variants))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

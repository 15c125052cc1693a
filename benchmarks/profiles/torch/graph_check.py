"""The captured train step (``compile(jit_compile=True)`` on torch) on GPUs: speed and exactness.

For each model (``keras.applications`` Xception 224x224 at global batch 64 and
ResNet-50 64x64 at batch 256, weights=None, 10 classes, random data, Adam 1e-3,
SparseCategoricalCrossentropy(from_logits=True)) it runs, from the same initial
weights:

  speed (TF32 as torch sets it: cuDNN on, matmul off), EPOCHS x STEPS steps, metric accuracy:
    plain   keras.Model.fit on one GPU (Keras's eager torch step)
    cap1    kmgpu, 1 GPU, jit_compile=True (graphs.CapturedStep on the user's model)
    eager2  kmgpu, 2 GPUs, Keras's eager step in DDP (the worker pool)
    cap2    kmgpu, 2 GPUs, jit_compile=True (captured, one flat all-reduce per step)
  samples/s of the median epoch after the first, and the first epoch's time;
  exactness (TF32 off everywhere: the pool is restarted with NVIDIA_TF32_OVERRIDE=0),
    one epoch of 6.5 batches (the half batch runs eagerly) from the same start:
    cap1 vs plain, plain vs plain again (cuDNN's own run-to-run noise), cap2 vs eager2;
  extras on one GPU if time is left: stage B eager (KMGPU_TORCH_CAPTURE_UPDATE=0), and
    Keras's numpy feed instead of GPU-resident rows (KMGPU_TORCH_RESIDENT=0).

Prints one table; writes ``results.json`` and the table to ``--out``.

    KERAS_BACKEND=torch python benchmarks/profiles/torch/graph_check.py --out /tmp/gc
    KERAS_BACKEND=torch python benchmarks/profiles/torch/graph_check.py --quick --out /tmp/gc   # CPU smoke
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

T0 = time.perf_counter()
RESULTS = {"runs": {}, "parity": {}, "info": {}}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def save(out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def spec(name, quick):
    if quick:
        return {"shape": (16, 16, 3), "batch": 8}
    return {"xception": {"shape": (224, 224, 3), "batch": 64},
            "resnet": {"shape": (64, 64, 3), "batch": 256}}[name]


def build(name, quick):
    import keras

    keras.utils.set_random_seed(1)
    s = spec(name, quick)
    if quick:
        inputs = keras.Input(s["shape"])
        h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(inputs, keras.layers.Dense(10)(h))
    cls = {"xception": keras.applications.Xception, "resnet": keras.applications.ResNet50}[name]
    return cls(weights=None, input_shape=s["shape"], classes=10, classifier_activation=None)


def make_data(name, quick, nbatches):
    import numpy as np

    s = spec(name, quick)
    n = int(nbatches * s["batch"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n,) + s["shape"], dtype=np.float32)
    y = rng.integers(0, 10, size=(n,)).astype(np.int32)
    return x, y


def compile_args(jit):
    import keras

    return dict(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"], jit_compile=jit)


def timer_callback():
    import keras

    # A History subclass: kmgpu's relay counts History as weight-free, so timing epochs
    # does not make the pool snapshot the weights at every epoch end.
    class EpochTimes(keras.callbacks.History):
        def __init__(self):
            super().__init__()
            self.times, self._t = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._sync()
            self._t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self._sync()
            self.times.append(time.perf_counter() - self._t)

        @staticmethod
        def _sync():
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    return EpochTimes()


def run_one(kind, name, model, init, x, y, batch, epochs, quick):
    """One fit; returns (epoch times, the ParallelModel or None)."""
    import kmgpu

    model.set_weights(init)
    gpus = {"plain": None, "cap1": 1, "eager2": 2, "cap2": 2}[kind.split(":")[0]]
    jit = kind.startswith("cap")
    runner = model
    if gpus is not None:
        runner = kmgpu.parallelize(model, gpus=gpus)
    runner.compile(**compile_args(jit))
    cb = timer_callback()
    runner.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb])
    if gpus is not None and kind.startswith("cap2"):
        RESULTS["info"].setdefault("describe", {}).setdefault(name, runner.describe())
    step = getattr(getattr(runner, "_engine", None), "_step", None)
    notes = {}
    if step is not None:
        notes = {"graphs": len(step.graphs), "fallback": step.reason,
                 "update_eager": step.update_reason or (not step.capture_update)}
    return cb.times, runner, notes


def weights_of(model):
    return [w.copy() for w in model.get_weights()]


def rel(a_list, b_list):
    """(global ||a-b||/||b||, worst per-tensor max|a-b|/max(max|b|, 1e-3)) in float64."""
    import numpy as np

    num = den = worst = 0.0
    for a, b in zip(a_list, b_list):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        num += float(np.sum((a - b) ** 2))
        den += float(np.sum(b ** 2))
        worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-3))
    return {"global": (num ** 0.5) / max(den ** 0.5, 1e-30), "worst": worst}


def speed(names, args):
    for name in names:
        import numpy as np

        s = spec(name, args.quick)
        x, y = make_data(name, args.quick, args.steps)
        model = build(name, args.quick)
        init = weights_of(model)
        for kind in ("plain", "cap1", "eager2", "cap2"):
            key = f"{name}:{kind}"
            if time.perf_counter() - T0 > args.budget_s - args.reserve_s:
                RESULTS["runs"][key] = {"skipped": "time"}
                log(key, "skipped (time)")
                continue
            try:
                t = time.perf_counter()
                times, runner, notes = run_one(kind, name, model, init, x, y, s["batch"],
                                               args.epochs, args.quick)
                later = times[1:] or times
                RESULTS["runs"][key] = {
                    "epoch_s": times, "first_epoch_s": times[0],
                    "samples_per_s": len(x) / statistics.median(later),
                    "wall_s": time.perf_counter() - t, **notes}
                log(key, json.dumps(RESULTS["runs"][key], default=str))
            except Exception as e:
                RESULTS["runs"][key] = {"error": f"{type(e).__name__}: {e}"}
                log(key, "FAILED", traceback.format_exc())
            save(args.out)
            gc.collect()
        del model, x, y
        gc.collect()
        np.random.seed(0)


def parity(names, args):
    """TF32 off everywhere; one epoch of 6.5 batches from the same start."""
    import torch

    import kmgpu.engines.torch.launch.launchers as launchers

    launchers.close_pools()  # new workers start with TF32 off
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in names:
        s = spec(name, args.quick)
        x, y = make_data(name, args.quick, 6.5)
        model = build(name, args.quick)
        init = weights_of(model)
        got = {}
        for kind in ("plain", "plain:again", "cap1", "eager2", "cap2"):
            if time.perf_counter() - T0 > args.budget_s - 10:
                log(name, kind, "parity skipped (time)")
                break
            try:
                run_one(kind, name, model, init, x, y, s["batch"], 1, args.quick)
                got[kind] = weights_of(model)
            except Exception:
                log(name, kind, "parity FAILED", traceback.format_exc())
        pairs = {"cap1 vs plain": ("cap1", "plain"), "plain again vs plain": ("plain:again", "plain"),
                 "cap2 vs eager2": ("cap2", "eager2"), "eager2 vs plain": ("eager2", "plain")}
        RESULTS["parity"][name] = {k: rel(got[a], got[b]) for k, (a, b) in pairs.items()
                                   if a in got and b in got}
        log(name, "parity", json.dumps(RESULTS["parity"][name]))
        save(args.out)
        del model
        gc.collect()


def extras(names, args):
    """One GPU, TF32 as in speed(): stage B eager; Keras's numpy feed."""
    import torch

    torch.backends.cudnn.allow_tf32 = True
    os.environ.pop("NVIDIA_TF32_OVERRIDE", None)
    for name in names:
        s = spec(name, args.quick)
        x, y = make_data(name, args.quick, args.steps)
        model = build(name, args.quick)
        init = weights_of(model)
        for env, label in (("KMGPU_TORCH_CAPTURE_UPDATE", "cap1:update_eager"),
                           ("KMGPU_TORCH_RESIDENT", "cap1:numpy_feed")):
            key = f"{name}:{label}"
            if time.perf_counter() - T0 > args.budget_s - 15:
                log(key, "skipped (time)")
                continue
            os.environ[env] = "0"
            try:
                times, _, notes = run_one(label, name, model, init, x, y, s["batch"],
                                          args.epochs, args.quick)
                later = times[1:] or times
                RESULTS["runs"][key] = {"epoch_s": times, "first_epoch_s": times[0],
                                        "samples_per_s": len(x) / statistics.median(later),
                                        **notes}
                log(key, json.dumps(RESULTS["runs"][key], default=str))
            except Exception:
                log(key, "FAILED", traceback.format_exc())
            finally:
                os.environ.pop(env, None)
            save(args.out)
        del model
        gc.collect()


def table():
    labels = [("plain", "plain fit, 1 GPU (Keras eager)"), ("cap1", "kmgpu captured, 1 GPU"),
              ("eager2", "kmgpu eager (DDP), 2 GPUs"), ("cap2", "kmgpu captured, 2 GPUs"),
              ("cap1:update_eager", "kmgpu captured A only (B eager), 1 GPU"),
              ("cap1:numpy_feed", "kmgpu captured, 1 GPU, Keras's numpy feed")]
    lines = ["| model | run | samples/s | x plain | first epoch s | notes |",
             "|---|---|---|---|---|---|"]
    names = sorted({k.split(":")[0] for k in RESULTS["runs"]})
    for name in names:
        base = RESULTS["runs"].get(f"{name}:plain", {}).get("samples_per_s")
        for kind, label in labels:
            r = RESULTS["runs"].get(f"{name}:{kind}")
            if r is None:
                continue
            if "samples_per_s" not in r:
                lines.append(f"| {name} | {label} | - | - | - | {r.get('error') or r.get('skipped')} |")
                continue
            sp = r["samples_per_s"]
            factor = f"{sp / base:.2f}" if base else "-"
            notes = ", ".join(f"{k}={v}" for k, v in r.items()
                              if k in ("graphs", "fallback", "update_eager") and v)
            lines.append(f"| {name} | {label} | {sp:,.0f} | {factor} | {r['first_epoch_s']:.1f} "
                         f"| {notes} |")
    lines += ["", "| model | comparison (TF32 off, 6.5 batches) | global rel | worst tensor |",
              "|---|---|---|---|"]
    for name, pairs in RESULTS["parity"].items():
        for k, v in pairs.items():
            lines.append(f"| {name} | {k} | {v['global']:.1e} | {v['worst']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/graph_check"))
    ap.add_argument("--models", default="resnet,xception")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=380.0)
    ap.add_argument("--reserve-s", type=float, default=110.0,
                    help="seconds kept for the exactness runs after the speed runs")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 simulated CPU devices")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import kmgpu

    if args.quick:
        kmgpu.simulate_devices(2)
    import keras
    import torch

    RESULTS["info"].update(
        torch=torch.__version__, keras=keras.__version__, python=sys.version.split()[0],
        gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        args=vars(args))
    log("info", json.dumps(RESULTS["info"]))
    names = args.models.split(",")
    speed(names, args)
    parity(names, args)
    extras(names, args)
    text = table()
    print(text, flush=True)
    for name, d in RESULTS["info"].get("describe", {}).items():
        print(d, flush=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    save(args.out)
    from kmgpu.engines.torch.launch import launchers

    launchers.close_pools()


if __name__ == "__main__":
    main()

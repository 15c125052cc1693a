"""kmgpu's default torch step on one GPU against plain Keras ``fit``.

One process (``KERAS_BACKEND=torch``); what each random layer does in the captured step, and
what falls back to eager, is tested in ``tests/torch/test_default_step.py``.

table: keras.applications models (weights=None, 10 classes), the bench's transformer and
  LSTM (``kmgpu.bench.workloads``): plain ``fit`` and kmgpu's default from the same
  initial weights, EPOCHS epochs of STEPS steps of synthetic data (samples/s: median
  epoch after the first), the first epoch's time, peak GPU memory; then, with TF32 off
  and cuDNN deterministic, both again for PARITY_STEPS steps with the random layers'
  rates set to 0 (their draws differ by design): the largest relative weight difference.

    KERAS_BACKEND=torch python benchmarks/lab/torch_default.py --out /tmp/td           # GPU
    KERAS_BACKEND=torch python benchmarks/lab/torch_default.py --quick --out /tmp/td   # CPU smoke

Writes ``results.json`` and ``table.md`` to ``--out`` after every model (a timeout
keeps what was measured); models that would not fit ``--budget`` seconds are skipped.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

T0 = time.perf_counter()
#: kmgpu's runs compile with these (--quick on a CPU: jit_compile=True, the split step that
#: a GPU captures, run eagerly, so the smoke runs the GPU's code path)
KMGPU_COMPILE = {}
NOISE = False  # --noise: the weights column also says plain fit against plain fit
RESULTS = {"info": {}, "checks": {}, "models": {}}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def rel_diff(a, b):
    worst = 0.0
    for u, v in zip(a, b):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        if u.size:
            worst = max(worst, float(np.max(np.abs(u - v)) / max(np.max(np.abs(u)), 1e-3)))
    return worst


def cuda():
    import torch

    return torch.cuda.is_available()


def sync():
    import torch

    if cuda():
        torch.cuda.synchronize()


def mem():
    import torch

    return torch.cuda.memory_allocated() if cuda() else 0


@contextlib.contextmanager
def exact():
    """TF32 off, cuDNN deterministic: what the weights columns are measured under."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


def step_state(parallel):
    """(captured?, why not) of a one-device ParallelModel's CapturedStep."""
    step = getattr(parallel._engine, "_step", None)
    if step is None:
        return False, "no captured step (Keras's step: " + parallel.describe().split(
            "train step")[-1].strip()[:120] + ")"
    if step.graphs and step.reason is None:
        return True, step.update_reason
    return False, step.reason or ("no CUDA device" if not cuda() else "not captured yet")


def epoch_timer():
    import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.records = [], []

        def on_epoch_begin(self, epoch, logs=None):
            sync()
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            sync()
            self.times.append(time.perf_counter() - self.start)

    return Timer()


def applications(image):
    import keras
    from keras.src.applications.convnext import MODEL_CONFIGS, ConvNeXt  # drop_path_rate

    A = keras.applications
    kw = dict(weights=None, input_shape=(image, image, 3), classes=10,
              classifier_activation=None)

    def convnext():
        return ConvNeXt(depths=MODEL_CONFIGS["tiny"]["depths"],
                        projection_dims=MODEL_CONFIGS["tiny"]["projection_dims"],
                        drop_path_rate=0.1, layer_scale_init_value=1e-6,
                        name="convnext_tiny_dp", **kw)

    return {  # the models first
        "EfficientNetB0": lambda: A.EfficientNetB0(**kw),
        "MobileNetV3Small": lambda: A.MobileNetV3Small(**kw),
        "ConvNeXtTiny drop_path 0.1": convnext,
        "EfficientNetV2B0": lambda: A.EfficientNetV2B0(**kw),
        "ResNet50": lambda: A.ResNet50(**kw),
        "MobileNetV3Large": lambda: A.MobileNetV3Large(**kw),
        "Xception": lambda: A.Xception(**kw),
        "EfficientNetB1": lambda: A.EfficientNetB1(**kw),
        "MobileNetV2": lambda: A.MobileNetV2(**kw),
        "DenseNet121": lambda: A.DenseNet121(**kw),
        "EfficientNetB2": lambda: A.EfficientNetB2(**kw),
        "EfficientNetB3": lambda: A.EfficientNetB3(**kw),
        "InceptionV3": lambda: A.InceptionV3(**kw),
    }


def image_data(n, image, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((min(n, 256), image, image, 3), dtype=np.float32)
    return np.resize(x, (n, image, image, 3)), rng.integers(0, 10, n).astype("int32")


def zero_random_rates(model):
    """Random layers off (their draws differ between the two steps by design)."""
    for layer in model._flatten_layers():
        for attr in ("rate", "drop_path_rate", "stddev"):
            if isinstance(getattr(layer, attr, None), float) and type(layer).__name__ in (
                    "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                    "StochasticDepth", "GaussianNoise", "GaussianDropout", "AlphaDropout"):
                setattr(layer, attr, 0.0)


def run_fit(model, init, compile_args, x, y, batch, epochs, default):
    import torch

    import kmgpu

    model.set_weights(init)
    runner = kmgpu.parallelize(model, gpus=1) if default else model
    runner.compile(**compile_args(), **(KMGPU_COMPILE if default else {}))
    if cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    reserved = torch.cuda.memory_reserved() if cuda() else 0
    timer = epoch_timer()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        runner.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                   callbacks=[timer])
    samples = len(x) if not isinstance(x, dict) else len(next(iter(x.values())))
    res = {"first_epoch_s": timer.times[0],
           "samples_per_s": samples / statistics.median(timer.times[1:] or timer.times),
           "peak_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda() else 0.0,
           "printed": [ln for ln in text.getvalue().splitlines() if "kmgpu (torch)" in ln]}
    if default:
        from kmgpu.engines.torch.capture import graphs

        res["captured"], res["why"] = step_state(runner)
        step = runner._engine._step
        pools = list(step.pools) if step is not None else []
        res["graph_mib"] = runner._engine.graph_memory() / 2**20
        runner.close()
        res["graph_mib_after_close"] = graphs.pool_bytes(pools) / 2**20
        res["reserved_after_close_mib"] = ((torch.cuda.memory_reserved() if cuda() else 0)
                                           - reserved) / 2**20
    return res


def run_parity(model, init, compile_args, x, y, batch):
    import kmgpu

    weights = []
    with exact():
        for default in (False, True) + ((False,) if NOISE else ()):
            model.set_weights(init)
            runner = kmgpu.parallelize(model, gpus=1, tf32=False) if default else model
            runner.compile(**compile_args(), **(KMGPU_COMPILE if default else {}))
            with contextlib.redirect_stdout(io.StringIO()):
                runner.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            weights.append(model.get_weights())
            if default:
                runner.close()
    if NOISE:  # Keras's eager step against itself: the GPU's own run-to-run noise
        return rel_diff(*weights[:2]), rel_diff(weights[0], weights[2])
    return rel_diff(*weights), None


def table_entries(args):
    import keras

    from kmgpu.bench import workloads

    image, batch = (32, 8) if args.quick else (args.image, args.batch)
    adam = lambda: {"optimizer": keras.optimizers.Adam(1e-3),  # noqa: E731
                    "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    entries = []
    for name, build in applications(image).items():
        entries.append((f"{name} {image}x{image}", build, adam,
                        lambda n: image_data(n, image), batch))
    for at, wname in ((1, "transformer"), (2, "lstm")):  # early: in the table for sure
        w = workloads.get(wname, quick=args.quick, devices=1, steps=args.steps)
        entries.insert(at, (f"{wname} (bench)", w.build, w.compile_args,
                            lambda n, w=w: w.data(), w.batch))
    return entries


def markdown():
    info, models = RESULTS["info"], RESULTS["models"]
    lines = [f"# kmgpu's default torch step vs plain Keras fit, one {info.get('device')}",
             "", f"Keras {info.get('keras')}, torch {info.get('torch')}; "
             f"{info.get('epochs')} epochs x {info.get('steps')} steps of synthetic data, "
             "samples/s of the median epoch after the first; kmgpu `parallelize(model, "
             "gpus=1)` compiled the usual way (no jit_compile). Weights: relative to "
             f"Keras's eager step after {info.get('parity_steps')} steps from the same "
             "start, TF32 off, cuDNN deterministic, random layers' rates 0.", "",
             "| model | batch | captured | plain fit | kmgpu default | speed-up | first epoch "
             "plain / default | peak GiB plain / default | graphs MiB | weights vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in models.items():
        if "error" in r:
            lines.append(f"| {name} | | error: {r['error'][:120]} | | | | | | | |")
            continue
        p, d = r["plain"], r["default"]
        cap = "yes" if d["captured"] else f"**no**: {d['why']}"
        lines.append(
            f"| {name} | {r['batch']} | {cap} | {p['samples_per_s']:,.0f} | "
            f"{d['samples_per_s']:,.0f} | {d['samples_per_s'] / p['samples_per_s']:.2f}x | "
            f"{p['first_epoch_s']:.1f} s / {d['first_epoch_s']:.1f} s | "
            f"{p['peak_gib']:.2f} / {d['peak_gib']:.2f} | {d['graph_mib']:.0f} | "
            f"{r.get('weights_diff', float('nan')):.1e}"
            + (f" (eager vs eager {r['eager_vs_eager']:.1e})" if r.get("eager_vs_eager")
               is not None else "") + " |")
    return "\n".join(lines) + "\n"


def save(out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--parity-steps", type=int, default=6)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--only", default="", help="comma-separated model name prefixes")
    ap.add_argument("--noise", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import keras
    import torch

    global NOISE
    NOISE = args.noise
    if args.quick:
        args.steps, args.epochs, args.parity_steps = 4, 2, 4
        if not cuda():
            KMGPU_COMPILE["jit_compile"] = True
    RESULTS["info"] = {"keras": keras.__version__, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if cuda() else "CPU",
                       "epochs": args.epochs, "steps": args.steps,
                       "parity_steps": args.parity_steps, "argv": sys.argv}
    only = [s for s in args.only.split(",") if s]
    for name, build, compile_args, make_data, batch in table_entries(args):
        if only and not any(name.startswith(s) for s in only):
            continue
        if time.perf_counter() - T0 > args.budget:
            RESULTS["models"][name] = {"error": "skipped: over the time budget"}
            continue
        try:
            model = build()
            init = model.get_weights()
            x, y = make_data(args.steps * batch)
            r = {"batch": batch}
            r["plain"] = run_fit(model, init, compile_args, x, y, batch, args.epochs, False)
            r["default"] = run_fit(model, init, compile_args, x, y, batch, args.epochs, True)
            zero_random_rates(model)
            n = args.parity_steps * batch
            r["weights_diff"], r["eager_vs_eager"] = run_parity(model, init, compile_args, x[:n], y[:n], batch)
        except Exception:
            r = {"error": traceback.format_exc()[-800:]}
        RESULTS["models"][name] = r
        log(f"{name}: {json.dumps(r, default=str)[:600]}")
        save(args.out)
        model = None
    print(markdown())


if __name__ == "__main__":
    main()

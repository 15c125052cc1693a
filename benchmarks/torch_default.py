"""kmgpu's default torch step on one GPU against plain Keras ``fit``.

Two parts, one process (``KERAS_BACKEND=torch``):

checks (random layers in the captured step, and what falls back):
  layers      each random layer in a tiny model, fit through ``kmgpu.parallelize(model,
              gpus=1)`` compiled the usual way: captured or not (why), and whether the
              layer's output differs from step to step among the replayed steps (a
              recording layer after it keeps the first value of every row)
  seeded      an MLP with GaussianNoise, Dropout(seed=...), Dropout(noise_shape=...)
              trained twice from the same seed: the weights must be equal
  curve       the same MLP's loss per epoch, kmgpu's default (captured) against Keras's
              eager fit: the curves must track (the random draws differ)
  fallbacks   ``.item()`` in a layer's call (capture refused, eager, one printed line,
              weights equal to plain fit) and a model's own ``train_step``
  memory      the graphs' GPU memory, and what ``close()`` gives back

table: keras.applications models (weights=None, 10 classes), the bench's transformer and
  LSTM (``kmgpu.bench.workloads``): plain ``fit`` and kmgpu's default from the same
  initial weights, EPOCHS epochs of STEPS steps of synthetic data (samples/s: median
  epoch after the first), the first epoch's time, peak GPU memory; then, with TF32 off
  and cuDNN deterministic, both again for PARITY_STEPS steps with the random layers'
  rates set to 0 (their draws differ by design): the largest relative weight difference.

    KERAS_BACKEND=torch python benchmarks/torch_default.py --out /tmp/td           # GPU
    KERAS_BACKEND=torch python benchmarks/torch_default.py --quick --out /tmp/td   # CPU smoke

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


# -- checks ------------------------------------------------------------------------------
def recorder():
    import keras

    class Record(keras.layers.Layer):
        """Keeps the first value of every row of its input (training only): a device
        write inside the step, so a replay updates it too."""

        def build(self, shape):
            self.seen = self.add_weight(shape=(shape[0],), initializer="zeros",
                                        trainable=False, name="seen")

        def call(self, x, training=None):
            if training:
                flat = keras.ops.reshape(x, (keras.ops.shape(x)[0], -1))
                self.seen.assign(keras.ops.cast(flat[:, 0], "float32"))
            return x

    return Record


def random_layers():
    import keras

    L = keras.layers
    image = [
        ("RandomFlip", lambda: L.RandomFlip(seed=1)),
        ("RandomRotation", lambda: L.RandomRotation(0.3, seed=2)),
        ("RandomZoom", lambda: L.RandomZoom(0.3, seed=3)),
        ("RandomCrop", lambda: L.RandomCrop(12, 12, seed=4)),
        ("RandomTranslation", lambda: L.RandomTranslation(0.3, 0.3, seed=5)),
        ("RandomContrast", lambda: L.RandomContrast(0.5, seed=6)),
        ("RandomBrightness", lambda: L.RandomBrightness(0.3, seed=7)),
        ("SpatialDropout2D", lambda: L.SpatialDropout2D(0.3, seed=8)),
        ("Dropout(noise_shape)", lambda: L.Dropout(0.3, noise_shape=(None, 1, 1, 3))),
        ("GaussianNoise(image)", lambda: L.GaussianNoise(0.3)),
    ]
    flat = [
        ("Dropout(seed)", lambda: L.Dropout(0.3, seed=9)),
        ("Dropout", lambda: L.Dropout(0.3)),
        ("GaussianNoise", lambda: L.GaussianNoise(0.3, seed=10)),
        ("GaussianDropout", lambda: L.GaussianDropout(0.3, seed=11)),
        ("AlphaDropout", lambda: L.AlphaDropout(0.3, seed=12)),
        ("keras.random.normal (user layer)", lambda: user_noise()),
    ]
    return image, flat


def user_noise():
    import keras

    class Noise(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.gen = keras.random.SeedGenerator(13)

        def call(self, x, training=None):
            if training:
                return x + keras.random.normal(keras.ops.shape(x), seed=self.gen)
            return x

    return Noise()


def check_layers(steps=8, batch=16):
    import keras

    import kmgpu

    out = {}
    image, flat = random_layers()
    rng = np.random.default_rng(0)
    for kind, entries in (("image", image), ("flat", flat)):
        for name, make in entries:
            keras.utils.set_random_seed(1)
            shape = (16, 16, 3) if kind == "image" else (8,)
            inputs = keras.Input(shape, batch_size=batch)
            h = recorder()(name="record")(make()(inputs))
            if kind == "image":
                h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(h))
            model = keras.Model(inputs, keras.layers.Dense(1)(h))
            x = rng.random((batch * steps, *shape)).astype("float32") + 0.5
            y = rng.random((batch * steps, 1)).astype("float32")
            parallel = kmgpu.parallelize(model, gpus=1)
            parallel.compile(optimizer="adam", loss="mse", **KMGPU_COMPILE)
            seen = []
            cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(
                model.get_layer("record").seen.numpy().copy()))
            text = io.StringIO()
            try:
                with contextlib.redirect_stdout(text):
                    parallel.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                                 callbacks=[cb])
                captured, why = step_state(parallel)
                replayed = [s.tobytes() for s in seen[3:]]
                out[name] = {"captured": captured, "why": why,
                             "fresh": len(set(replayed)) == len(replayed) and len(replayed) > 1,
                             "printed": text.getvalue().strip()[-300:]}
            except Exception as e:  # reported, the rest goes on
                out[name] = {"captured": False, "why": f"{type(e).__name__}: {e}"[:300],
                             "fresh": False}
            parallel.close()
            log(f"layer {name}: {out[name]}")
    return out


def noisy_mlp(seed=3):
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    return keras.Sequential([keras.Input((16,)), L.GaussianNoise(0.1, seed=1),
                             L.Dense(64, activation="relu"), L.Dropout(0.2, seed=2),
                             L.Dense(64, activation="relu"),
                             L.Dropout(0.2, noise_shape=(None, 1)), L.Dense(1)])


def regression(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype("float32")
    return x, np.tanh(x @ rng.standard_normal((16, 1))).astype("float32")


def check_seeded_and_curve(epochs, steps, batch=32):
    import kmgpu

    x, y = regression(steps * batch)
    weights, curves, states = [], {}, []
    for run in ("default", "default again"):
        model = noisy_mlp()
        parallel = kmgpu.parallelize(model, gpus=1)
        parallel.compile(optimizer="adam", loss="mse", **KMGPU_COMPILE)
        h = parallel.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        states.append(step_state(parallel))
        curves[run] = h.history["loss"]
        weights.append(model.get_weights())
        parallel.close()
    model = noisy_mlp()
    model.compile(optimizer="adam", loss="mse")
    curves["plain fit"] = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False,
                                    verbose=0).history["loss"]
    a, b = np.array(curves["default"]), np.array(curves["plain fit"])
    return {"seeded_weights_diff": rel_diff(*weights), "captured": states,
            "curves": curves, "curve_max_rel_gap": float(np.max(np.abs(a - b) / b))}


def check_fallbacks(batch=16, steps=8):
    import keras

    import kmgpu

    class Item(keras.layers.Layer):  # data-dependent Python control flow
        def call(self, x):
            if float(keras.ops.convert_to_numpy(keras.ops.sum(x))) > -1e30:
                return x * 1.0
            return x

    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    out = {}
    x, y = regression(batch * steps)
    for name in ("item", "own train_step"):
        results = []
        for how in ("plain", "default"):
            keras.utils.set_random_seed(5)
            inputs = keras.Input((16,))
            h = keras.layers.Dense(32, activation="relu")(inputs)
            if name == "item":
                h = Item()(h)
            cls = Own if name == "own train_step" else keras.Model
            model = cls(inputs, keras.layers.Dense(1)(h))
            runner = model if how == "plain" else kmgpu.parallelize(model, gpus=1, tf32=False)
            runner.compile(optimizer="adam", loss="mse", **({} if how == "plain" else
                                                           KMGPU_COMPILE))
            text = io.StringIO()
            with exact(), contextlib.redirect_stdout(text):
                runner.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
            results.append((model.get_weights(), text.getvalue()))
            if how == "default":
                out[name] = {"printed": [ln for ln in text.getvalue().splitlines()
                                         if "kmgpu" in ln],
                             "describe": runner.describe().split("train step")[-1][:200]}
                runner.close()
        out[name]["weights_diff"] = rel_diff(results[0][0], results[1][0])
        log(f"fallback {name}: {out[name]}")
    return out


# -- the table ---------------------------------------------------------------------------
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
    ap.add_argument("--no-checks", action="store_true")
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
    if not args.no_checks:
        for name, fn in (("layers", check_layers),
                         ("seeded_and_curve", lambda: check_seeded_and_curve(
                             3 if args.quick else 6, 5 if args.quick else 20)),
                         ("fallbacks", check_fallbacks)):
            try:
                RESULTS["checks"][name] = fn()
            except Exception:
                RESULTS["checks"][name] = {"error": traceback.format_exc()[-1500:]}
            log(f"check {name}: {json.dumps(RESULTS['checks'][name], default=str)[:1500]}")
            save(args.out)
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

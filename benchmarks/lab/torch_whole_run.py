"""Plain Keras fit against kmgpu's captured torch step, order-balanced, on one GPU.

table (``--part bench``): plain Keras against kmgpu's default, order-balanced in one
  process (plain, kmgpu, plain, kmgpu; the figure is the better of each side's two):
  fit without and with validation (samples/s, median epoch after the first), evaluate
  and predict (seconds, the median of calls after the first), under float32,
  mixed_float16 and mixed_bfloat16, for ResNet-50 64x64 (batch 256), a BERT-style
  encoder with Dropout in attention, and an LSTM.

set (``--part bench --set default``): the model set of torch_default.py (13
  keras.applications models at 128x128, batch 64, the bench's transformer and LSTM),
  float32 (``--only mixed_float16 mixed_bfloat16``: those rows), the same four runs each
  at a small size (``--budget`` seconds: the models left when it is spent are named in
  the JSON as not run).

    KERAS_BACKEND=torch python benchmarks/lab/torch_whole_run.py --part bench --quick --out /tmp/w
    KERAS_BACKEND=torch python benchmarks/lab/torch_whole_run.py --part bench --set default --out /tmp/w

Every fallback of the same path, forced, and its parity with plain Keras:
``torch_capture_checks.py``.
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

# the CUDA probe of torch_default.py (the same script family)
from torch_default import cuda

T0 = time.perf_counter()
OUT = {"bench": {}}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def quiet(fn):
    """``fn()``, and the lines kmgpu's torch engine printed meanwhile."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out = fn()
    return out, [ln for ln in text.getvalue().splitlines() if "kmgpu (torch)" in ln]


# -- table --------------------------------------------------------------------------------
class EpochTimer:
    def __init__(self):
        import keras

        class T(keras.callbacks.Callback):
            def on_epoch_begin(s, epoch, logs=None):
                sync()
                s.t = time.perf_counter()

            def on_epoch_end(s, epoch, logs=None):
                sync()
                self.times.append(time.perf_counter() - s.t)

        self.times, self.callback = [], T()


def sync():
    if cuda():
        import torch

        torch.cuda.synchronize()


def resnet(image):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3),
                                           classes=10, classifier_activation=None)

    def data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((min(n, 256), image, image, 3), dtype=np.float32)
        return np.resize(x, (n, image, image, 3)), rng.integers(0, 10, n).astype("int32")

    return build, data, lambda: dict(optimizer="adam", metrics=["accuracy"], loss=keras.losses.
                                     SparseCategoricalCrossentropy(from_logits=True))


def bert(seq, vocab, d, heads, blocks):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        i = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, d)(i)
        for _ in range(blocks):
            a = keras.layers.MultiHeadAttention(heads, d // heads, dropout=0.1)(h, h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dropout(0.1)(a))
            f = keras.layers.Dense(4 * d, activation="gelu")(h)
            f = keras.layers.Dropout(0.1)(keras.layers.Dense(d)(f))
            h = keras.layers.LayerNormalization()(h + f)
        o = keras.layers.Dense(2, dtype="float32")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(i, o)

    def data(n, seed):
        rng = np.random.default_rng(seed)
        return rng.integers(1, vocab, (n, seq)).astype("int32"), rng.integers(0, 2, n).astype(
            "int32")

    return build, data, lambda: dict(optimizer="adam", metrics=["accuracy"], loss=keras.losses.
                                     SparseCategoricalCrossentropy(from_logits=True))


def lstm(seq, units):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((seq, 16)), keras.layers.LSTM(units),
                                 keras.layers.Dense(1)])

    def data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, seq, 16)).astype("float32")
        return x, x.mean(axis=(1, 2))[:, None]

    return build, data, lambda: dict(optimizer="adam", loss="mse", metrics=["mae"])


def one_run(model, init, compile_args, train, val, batch, epochs, default, with_eval,
            tf32=True):
    import kmgpu

    model.set_weights(init)
    runner = kmgpu.parallelize(model, gpus=1, tf32=tf32) if default else model
    runner.compile(**compile_args())
    res = {}
    for key, kw in [("fit", {}), ("fit+val", {"validation_data": val})]:
        t = EpochTimer()
        _, printed = quiet(lambda: runner.fit(*train, batch_size=batch, epochs=epochs,
                                              shuffle=False, verbose=0, callbacks=[t.callback],
                                              **kw))
        res[key] = len(train[0]) / statistics.median(t.times[1:] or t.times)
        res.setdefault("printed", []).extend(printed)
    if with_eval:
        for key, fn in [("evaluate", lambda: runner.evaluate(*val, batch_size=batch, verbose=0)),
                        ("predict", lambda: runner.predict(val[0], batch_size=batch,
                                                           verbose=0))]:
            times = []
            for _ in range(2 if ARGS.set == "default" else 3):  # the first call not counted
                sync()
                t0 = time.perf_counter()
                quiet(fn)
                sync()
                times.append(time.perf_counter() - t0)
            res[key] = statistics.median(times[1:])
    if default:
        res["describe"] = [ln for ln in runner.describe().splitlines() if "step" in ln.lower()
                           or "float32" in ln][:3]
        runner.close()
    return res


def default_set(quick):
    """torch_default.py's models: {name: ((build, data, compile_args), batch, n, nv)};
    6 training and 3 validation batches each (2 and 2 with --quick)."""
    import keras
    from torch_default import applications, image_data

    from kmgpu.bench import workloads

    image, batch = (32, 8) if quick else (128, 64)
    k, kv = (2, 2) if quick else (6, 3)
    n, nv = k * batch, kv * batch  # the images' rows; the bench's workloads: their batch
    adam = lambda: dict(optimizer="adam", metrics=["accuracy"],  # noqa: E731
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = {}
    for wname in ("lstm", "transformer"):
        w = workloads.get(wname, quick=quick, devices=1, steps=k)
        out[f"{wname} (bench)"] = ((w.build, lambda rows, seed, w=w: tuple(
            a[:rows] for a in w.data()), w.compile_args), w.batch, k * w.batch, kv * w.batch)
    for name, build in applications(image).items():
        out[f"{name} {image}x{image}"] = ((build, lambda k, s: image_data(k, image, s), adam),
                                          batch, n, nv)
    return out


def bench(quick, only):
    import keras

    sizes = dict(n=4096, nv=2048, image=64, batch=256, epochs=3)
    if quick:
        sizes = dict(n=64, nv=40, image=32, batch=16, epochs=2)
    if ARGS.set == "default":
        sizes["epochs"] = 2
        models = {k: (v[0], v[1]) for k, v in default_set(quick).items()}
        rows = {k: (v[2], v[3]) for k, v in default_set(quick).items()}
        only = only or ["float32"]  # --only mixed_float16 mixed_bfloat16: those rows
    else:
        rows = {}
        models = self_models(sizes, quick)
    start = time.perf_counter()
    for name, ((build, data, compile_args), batch) in models.items():
        if ARGS.models and not any(m in name for m in ARGS.models):
            continue
        if time.perf_counter() - start > ARGS.budget:
            OUT["bench"].setdefault("not run (time budget)", []).append(name)
            continue
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            if only and policy not in only:
                continue
            key = f"{name} | {policy}"
            keras.mixed_precision.set_global_policy(policy)
            try:
                n, nv = rows.get(name, (sizes["n"], sizes["nv"]))
                if "BERT" in name:
                    n, nv = n // 2, nv // 2
                train, val = data(n, 0), data(nv, 1)
                model = build()
                init = model.get_weights()
                sides = ["plain", "kmgpu"]
                if policy == "float32" and "BERT" in name:
                    sides.append("kmgpu tf32=False")  # the other float32 policy
                runs = {side: [] for side in sides}
                for side in sides + sides:
                    runs[side].append(one_run(model, init, compile_args, train, val, batch,
                                              sizes["epochs"], side != "plain",
                                              with_eval=policy == "float32" or "ResNet" in name,
                                              tf32="tf32=False" not in side))
                OUT["bench"][key] = runs
                log(key, json.dumps(runs)[:1500])
            except Exception:
                OUT["bench"][key] = {"error": traceback.format_exc()[-1500:]}
                log(key, "ERROR", traceback.format_exc()[-1500:])
            finally:
                keras.mixed_precision.set_global_policy("float32")
            save(ARGS.out)


def self_models(sizes, quick):
    return {
        "ResNet50 64x64": (resnet(sizes["image"]), sizes["batch"]),
        "BERT-style encoder (dropout in attention)": (
            bert(128, 8000, 256, 4, 4) if not quick else bert(16, 100, 32, 2, 1),
            64 if not quick else 8),
        "LSTM": (lstm(64, 128) if not quick else lstm(8, 8), 256 if not quick else 16),
    }


def best(runs, key, fn=max):
    vals = [r[key] for r in runs if key in r]
    return fn(vals) if vals else None


def markdown():
    lines = ["| model | policy | fit plain | fit kmgpu | x | fit+val plain | fit+val kmgpu | x "
             "| x(val)/x | evaluate plain s | kmgpu s | x | predict plain s | kmgpu s | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, runs in OUT["bench"].items():
        if key.startswith("not run"):
            lines.append(f"| {key}: {', '.join(runs)} |" + " |" * 14)
            continue
        if "error" in runs:
            lines.append(f"| {key} | error | | | | | | | | | | | | | |")
            continue
        p, k = runs["plain"], runs["kmgpu"]
        row = [*key.split(" | ")]
        sp = {}
        for m in ("fit", "fit+val"):
            a, b = best(p, m), best(k, m)
            sp[m] = b / a
            row += [f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.2f}x"]
        row.append(f"{sp['fit+val'] / sp['fit']:.2f}")
        if "kmgpu tf32=False" in runs:
            row[0] += (f" (kmgpu tf32=False: fit {best(runs['kmgpu tf32=False'], 'fit'):,.0f}, "
                       f"fit+val {best(runs['kmgpu tf32=False'], 'fit+val'):,.0f})")
        for m in ("evaluate", "predict"):
            a, b = best(p, m, min), best(k, m, min)
            row += ([f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"] if a and b else ["", "", ""])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def save(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{ARGS.part}.json"), "w") as f:
        json.dump(OUT, f, indent=1, default=str)
    if OUT["bench"]:
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write(markdown())


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["bench"], default="bench")
    p.add_argument("--set", choices=["issue", "default"], default="issue",
                   help="bench: ResNet-50, BERT-style and LSTM, or torch_default.py's model set")
    p.add_argument("--budget", type=float, default=1e9, help="bench: seconds for models")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", help="policies")
    p.add_argument("--models", nargs="*", help="substrings of model names")
    p.add_argument("--out", default="/tmp/whole_run")
    ARGS = p.parse_args()
    import torch

    OUT["info"] = {"torch": torch.__version__, "cuda": cuda(),
                   "gpu": torch.cuda.get_device_name() if cuda() else None}
    bench(ARGS.quick, ARGS.only)
    save(ARGS.out)
    if OUT["bench"]:
        print(markdown())
    log("done")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

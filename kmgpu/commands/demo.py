"""``kmgpu demo``: the sine-wave LSTM on one device, on N devices through kmgpu, and
the naive "batch x N" run that shows the trap multi_gpu_model users fell into.

Prints a table (devices, global batch, steps/epoch, train/test RMSE, seconds) and
saves a PNG of the series and the three predictions.
"""

import argparse
import math
import os
import subprocess
import sys
import time
import warnings

BACKENDS = ("tensorflow", "jax", "torch")


def _gpu_count():
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


DESCRIPTION = (
    "The sine-wave LSTM (series 60 sin(0.1 i), LSTM(4) + Dense(1), adam, batch 8) trained "
    "three ways: on one device, on N devices through kmgpu, and the naive 'batch x N' run "
    "that multi_gpu_model users fell into. Prints train/test RMSE per run and saves a PNG. "
    "Without GPUs, N simulated CPU devices stand in (they share this machine's cores, so "
    "their times are not speed-ups).")


def parse(argv):
    p = argparse.ArgumentParser(prog="kmgpu demo", description=DESCRIPTION)
    p.add_argument("--backend", default=None,
                   help="tensorflow, jax, torch or all (default: KERAS_BACKEND, else tensorflow)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices for the parallel runs (default: every GPU, else 4 simulated)")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--out", default="kmgpu-demo", help="folder for the PNG (default: ./kmgpu-demo)")
    return p.parse_args(argv)


def main(argv=None):
    """``kmgpu demo``: the reference sine-wave LSTM trained on one device and through
    kmgpu on N (simulated where there are no GPUs), with the naive batch x N beside
    them; prints the RMSE table and writes a PNG.

    Args:
        argv: the command's arguments (``kmgpu demo --help``).

    Returns:
        The exit status.
    """
    args = parse(sys.argv[1:] if argv is None else argv)
    backend = args.backend or os.environ.get("KERAS_BACKEND") or "tensorflow"
    if backend == "all":
        status = 0
        for b in BACKENDS:
            cmd = [sys.executable, "-m", "kmgpu", "demo", "--backend", b,
                   "--epochs", str(args.epochs), "--out", args.out]
            if args.devices:
                cmd += ["--devices", str(args.devices)]
            status |= subprocess.call(cmd, env={**os.environ, "KERAS_BACKEND": b})
        return status
    if backend not in BACKENDS:
        print(f"kmgpu demo: --backend must be one of {', '.join(BACKENDS)} or all", file=sys.stderr)
        return 2
    if "keras" in sys.modules and sys.modules["keras"].config.backend() != backend:
        print("kmgpu demo: keras is already imported with another backend", file=sys.stderr)
        return 2
    os.environ["KERAS_BACKEND"] = backend
    return run(backend, args.devices, args.epochs, args.out)


def _quiet_tensorflow_import():
    """Import TensorFlow once with the process's stderr silenced, if it is installed.

    Keras's ``set_random_seed`` imports TensorFlow whenever it is installed, whatever
    the backend, and TensorFlow 2.21 writes its absl/oneDNN start-up lines from C++,
    ignoring TF_CPP_MIN_LOG_LEVEL. A failing import is repeated loudly.
    """
    import importlib.util

    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow") is None:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                import tensorflow  # noqa: F401
            except Exception:
                pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run(backend, n, epochs, out):
    """The demo on one backend, in this process.

    Args:
        backend: the Keras backend this process runs.
        n: the number of devices for kmgpu.
        epochs: epochs of each fit.
        out: the folder for the table and the PNG.
    """
    _quiet_tensorflow_import()
    import kmgpu

    gpus = _gpu_count()
    if gpus == 0:
        n = n or 4
        kmgpu.simulate_devices(n)
        where = f"{n} simulated CPU devices sharing {os.cpu_count()} core(s)"
    else:
        n = min(n or gpus, gpus)
        where = f"{n} GPU(s)"
    import keras
    import numpy as np

    from kmgpu import sine

    (x_tr, y_tr), (x_te, y_te), scale = sine.data()
    print(f"kmgpu demo - backend {backend}, {where}; sine LSTM, {len(x_tr)} train / "
          f"{len(x_te)} test samples, {epochs} epochs")
    rows, predictions = [], {}
    runs = [
        ("1 device", 1, "global", sine.BATCH),
        (f"kmgpu, {n} devices", n, "global", sine.BATCH),
        (f"naive batch x {n}", n, "per_replica", sine.BATCH),
    ]
    for label, devices, policy, batch in runs:
        model = sine.model()
        print(f"  training: {label} ...", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-device note and the trap warning:
            parallel = kmgpu.parallelize(model, gpus=devices, batch=policy, scale_lr=False)
            parallel.compile(optimizer="adam", loss="mse")  # the table says both
            start = time.perf_counter()
            parallel.fit(x_tr, y_tr, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
            seconds = time.perf_counter() - start
        global_batch = batch * devices if policy == "per_replica" else batch
        # predict with the user's own model: it holds the trained weights
        rows.append((label, devices, global_batch, math.ceil(len(x_tr) / global_batch),
                     sine.rmse(model, x_tr, y_tr, scale), sine.rmse(model, x_te, y_te, scale),
                     seconds))
        lo, hi = scale
        predictions[label] = model.predict(np.concatenate([x_tr, x_te]), verbose=0)[:, 0] * (hi - lo) + lo
        parallel.close()
    header = ("run", "devices", "global batch", "steps/epoch", "train RMSE", "test RMSE", "seconds")
    print(_table(header, [(r[0], r[1], r[2], r[3], f"{r[4]:.2f}", f"{r[5]:.2f}", f"{r[6]:.1f}")
                          for r in rows]))
    same = "the same" if abs(rows[1][5] - rows[0][5]) < 0.01 else "a different"
    worse = "a worse" if rows[2][5] > rows[0][5] else "another"
    print(f"kmgpu on {n} devices takes the same {rows[0][3]} steps per epoch as one device and "
          f"reaches {same} test RMSE; multiplying the batch by {n} cuts the steps to "
          f"{rows[2][3]} and reaches {worse} one (the multi_gpu_model trap).")
    if gpus == 0:
        print(f"The simulated devices share {os.cpu_count()} CPU core(s): their seconds show "
              "no speed-up (GPU figures: benchmarks/RESULTS.md).")
    rmse = {r[0]: r[5] for r in rows}
    path = _plot(backend, predictions, rmse, out)
    if path:
        print(f"plot: {path}")
    return 0


def _table(header, rows):
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells[1:]])


def _plot(backend, predictions, rmse, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return None
    import numpy as np

    series = 60 * np.sin(0.1 * np.arange(160))
    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(series, color="black", lw=2, label="series 60 sin(0.1 i)")
    styles = [dict(lw=4, alpha=0.45), dict(lw=1.5, ls="--"), dict(lw=1.5)]  # 1 device under kmgpu
    for (label, pred), style in zip(predictions.items(), styles):
        ax.plot(np.arange(1, len(pred) + 1), pred, label=f"{label} (test RMSE {rmse[label]:.2f})",
                **style)
    ax.axvline(int(160 * 0.67), color="grey", ls=":", lw=1)
    ax.set_title(f"kmgpu demo ({backend}): next-value predictions; test starts at the dotted line")
    ax.set_xlabel("time step i")
    ax.set_ylabel("value (series units)")
    ax.legend(loc="lower left", fontsize=8)
    path = os.path.join(out, f"demo-{backend}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

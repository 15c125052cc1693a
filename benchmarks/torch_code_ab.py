"""torch under kmgpu: one version of kmgpu against another, order-balanced (A, B, A, B, one
process each), on ResNet-50 64x64 with validation every epoch, evaluate and predict.

    git archive <commit> kmgpu | tar -x -C /tmp/before
    python benchmarks/torch_code_ab.py --before /tmp/before

A run prints one RESULT line per process: samples/s (median epoch after the first,
validation included), the first epoch, evaluate and predict (each timed on its second call).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(size, rows, batch):
    import keras
    import numpy as np

    import kmgpu

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(rows,))
    keras.utils.set_random_seed(1)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    parallel = kmgpu.parallelize(model)
    epochs = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epochs.append(time.perf_counter() - self.start)

    parallel.fit(x, y, batch_size=batch, epochs=4, verbose=0, callbacks=[Timer()],
                 validation_data=(x[:1024], y[:1024]))
    result = {"samples_per_s": rows / float(np.median(epochs[1:])), "first_epoch": epochs[0]}
    for name in ("evaluate", "predict"):
        call = getattr(parallel, name)
        args = (x, y) if name == "evaluate" else (x,)
        call(*args, batch_size=batch, verbose=0)
        start = time.perf_counter()
        call(*args, batch_size=batch, verbose=0)
        result[name] = time.perf_counter() - start
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="a folder holding the other kmgpu (git archive)")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--rows", type=int, default=5120)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT", json.dumps(one_run(args.size, args.rows, args.batch)), flush=True)
        return
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONWARNINGS="ignore")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child = [sys.executable, os.path.abspath(__file__), "--child", "--size", str(args.size),
             "--rows", str(args.rows), "--batch", str(args.batch)]
    for _ in range(args.rounds):
        for code, first in (("before", args.before), ("after", ROOT)):
            env["PYTHONPATH"] = os.pathsep.join([first] + paths)
            out = subprocess.run(child, env=env, capture_output=True, text=True, cwd=first)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
            print(code, line[-1] if line else out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()

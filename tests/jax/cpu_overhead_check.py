"""kmgpu's overhead over ``keras.distribution.DataParallel`` + ``fit`` on simulated CPU
devices (a standalone script, not a pytest file).

    KERAS_BACKEND=jax .venv/bin/python tests/jax/cpu_overhead_check.py [--devices 4]

Same process, same initial weights, same data, runs interleaved (the machine's cores
are shared): per-step time (median epoch after the first, divided by its steps), the
cost of one more short ``fit`` call, and kmgpu's own phases per call (model identity,
weights in and out, the input checks).
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="short fit calls for the per-call cost")
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import kmgpu

    kmgpu.simulate_devices(args.devices)
    import jax
    import keras
    import numpy as np

    from kmgpu import checks
    from kmgpu.engines import replication

    batch = 8 * args.devices
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * args.steps, 32)).astype("float32")
    y = rng.normal(size=(batch * args.steps, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.BatchNormalization(),
                                 keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(1)])

    init = build().get_weights()
    phases = {}

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                phases.setdefault(label, []).append(time.perf_counter() - start)

        setattr(owner, name, wrapper)

    timed(replication, "identity", "model identity (config json)")
    timed(replication, "copy_state", "weights + optimizer state in/out")
    timed(checks, "call", "argument and data checks")

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    def per_step(fit):
        timer = Timer()
        timer.seconds = []
        fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=0,
            callbacks=[timer])
        return statistics.median(timer.seconds[1:]) / args.steps

    def per_call(fit):
        fit(x[:batch * 2], y[:batch * 2], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        start = time.perf_counter()
        for _ in range(args.calls):
            fit(x[:batch * 2], y[:batch * 2], batch_size=batch, epochs=1, shuffle=False,
                verbose=0)
        return (time.perf_counter() - start) / args.calls

    results = {"DataParallel": [], "kmgpu local BN": [], "kmgpu sync BN": []}
    calls = {k: [] for k in results}
    first = {k: [] for k in results}
    for _ in range(args.repeats):
        for runner in results:
            if runner == "DataParallel":
                distribution = keras.distribution.DataParallel(
                    devices=jax.devices()[:args.devices])
                with distribution.scope():
                    model = build()
                    model.set_weights(init)
                    model.compile(optimizer="adam", loss="mse")
                    start = time.perf_counter()
                    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
                    first[runner].append(time.perf_counter() - start)
                    results[runner].append(per_step(model.fit))
                    calls[runner].append(per_call(model.fit))
            else:
                model = build()
                model.set_weights(init)
                parallel = kmgpu.parallelize(model, gpus=args.devices,
                                             sync_batchnorm=runner.endswith("sync BN"))
                parallel.compile(optimizer="adam", loss="mse")
                start = time.perf_counter()
                parallel.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
                first[runner].append(time.perf_counter() - start)
                phases.clear()
                results[runner].append(per_step(parallel.fit))
                calls[runner].append(per_call(parallel.fit))
    base, base_min = statistics.median(results["DataParallel"]), min(results["DataParallel"])
    print(f"\n{args.devices} simulated CPU devices, MLP 32-64-BN-64-1, batch {batch}, "
          f"{args.steps} steps/epoch, {args.repeats} interleaved runs (median; min)")
    print(f"{'runner':<16} {'ms/step':>15} {'vs DP':>13} {'ms/extra fit call':>18} "
          f"{'first call s':>13}")
    for runner, values in results.items():
        step, low = statistics.median(values), min(values)
        print(f"{runner:<16} {step * 1e3:7.3f}; {low * 1e3:5.3f} {step / base:6.2f}; "
              f"{low / base_min:4.2f} {statistics.median(calls[runner]) * 1e3:18.1f} "
              f"{statistics.median(first[runner]):13.2f}")
    print("\nkmgpu's own phases per call (last kmgpu runner), ms: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} (x{len(v)})"
                      for k, v in phases.items()))


if __name__ == "__main__":
    main()

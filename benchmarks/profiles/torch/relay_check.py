"""Why ``kmgpu bench``'s captured torch runs scaled less than ``graph_check.py``'s (section 7).

The same model, data and ``compile(jit_compile=True)``, two ways of calling ``fit`` on N
ranks (a pool), as the two scripts do:

  check   graph_check.py: one callback, a ``keras.callbacks.History`` subclass timing the
          epochs (weight-free for kmgpu's relay);
  bench   kmgpu bench (``runners._fit``): ``kmgpu.callbacks.EpochTimer`` and
          ``GPUMonitor`` (plus the same timer, so both are timed alike).

For each, epochs of S1 and S2 steps: the epoch time is fixed + S x per-step, so the
two give the per-epoch fixed cost and the per-step cost. It also counts, per call, the
driver's state loads and rank 0's snapshots, and the bytes of one snapshot (weights +
optimizer state), and prints rank 0's ``KMGPU_TORCH_TIMING`` lines.

    KERAS_BACKEND=torch python benchmarks/profiles/torch/relay_check.py [--before]   # CPU, 2 gloo ranks
    KERAS_BACKEND=torch python benchmarks/profiles/torch/relay_check.py --gpus 2 --image 16 --batch 64 \
        --width 8192 --steps 5,20 [--before]                                # 2 GPUs
"""

import argparse
import json
import os
import statistics
import sys
import time


def build(width, image):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((image, image, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(width, activation="relu")(h)  # the parameters: relay bytes
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def timer():
    import keras

    class EpochTimes(keras.callbacks.History):  # weight-free for kmgpu's relay
        def __init__(self):
            super().__init__()
            self.times, self._t = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._t)

    return EpochTimes()


def counting():
    """Count the driver's state loads (the engine's CallbackDriver calls them)."""
    from kmgpu.engines.torch.launch import launchers

    counts = {"loads": 0}
    original = launchers.PoolLauncher.load_state

    def load_state(self, template):
        counts["loads"] += 1
        return original(self, template)

    launchers.PoolLauncher.load_state = load_state
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--image", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", default="2,10")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--before", action="store_true",
                    help="as before the fix: EpochTimer and GPUMonitor not weight-free (the "
                         "driver loads rank 0's state at every epoch end)")
    args = ap.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "torch")
    os.environ.setdefault("KMGPU_TORCH_TIMING", "1")
    import numpy as np

    import kmgpu

    import torch

    if not torch.cuda.is_available():
        kmgpu.simulate_devices(args.gpus)
    import keras

    from kmgpu.callbacks import EpochTimer, GPUMonitor

    counts = counting()
    if args.before:
        from kmgpu.engines.torch.launch import relay

        relay._declared_weight_free = lambda callback: False
    model = build(args.width, args.image)
    init = model.get_weights()
    params = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    parallel = kmgpu.parallelize(model, gpus=args.gpus)
    results = {"params": params, "snapshot_bytes": None, "runs": {}}
    rng = np.random.default_rng(0)
    for steps in [int(s) for s in args.steps.split(",")]:
        n = steps * args.batch
        x = rng.standard_normal((n, args.image, args.image, 3), dtype=np.float32)
        y = rng.integers(0, 10, size=(n,)).astype(np.int32)
        for rep in range(args.repeat):
            for pattern in ("check", "bench"):
                model.set_weights(init)
                parallel.compile(optimizer=keras.optimizers.Adam(1e-3),
                                 loss=keras.losses.SparseCategoricalCrossentropy(
                                     from_logits=True),
                                 metrics=["accuracy"], jit_compile=True)
                cb = timer()
                callbacks = [cb]
                if pattern == "bench":
                    callbacks += [EpochTimer(n), GPUMonitor(interval=0.2, verbose=0)]
                counts["loads"] = 0
                print(f"-- {pattern}, {steps} steps per epoch, repeat {rep}", flush=True)
                parallel.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                             verbose=0, callbacks=callbacks)
                later = cb.times[1:]
                key = f"{pattern}:{steps}"
                run = results["runs"].setdefault(key, {"epoch_ms": [], "loads": []})
                run["epoch_ms"].append(1e3 * statistics.median(later))
                run["loads"].append(counts["loads"])
                if results["snapshot_bytes"] is None:
                    from kmgpu.engines.torch import replicas

                    _, arrays = replicas.state_of(model, with_optimizer=True)
                    results["snapshot_bytes"] = int(sum(a.nbytes for a in arrays))
    s1, s2 = [int(s) for s in args.steps.split(",")][:2]
    lines = [f"params {params:,}; one snapshot (weights + Adam state) "
             f"{results['snapshot_bytes'] / 2**20:.1f} MiB; {args.gpus} ranks, batch "
             f"{args.batch}, {args.epochs} epochs (median of epochs 2..)",
             "| pattern | ms/epoch at S1 | ms/epoch at S2 | per step (ms) | fixed per epoch (ms) "
             "| driver state loads per fit |", "|---|---|---|---|---|---|"]
    for pattern in ("check", "bench"):
        a = min(results["runs"][f"{pattern}:{s1}"]["epoch_ms"])
        b = min(results["runs"][f"{pattern}:{s2}"]["epoch_ms"])
        per_step = (b - a) / (s2 - s1)
        fixed = a - s1 * per_step
        loads = results["runs"][f"{pattern}:{s2}"]["loads"]
        results["runs"][pattern] = {"per_step_ms": per_step, "fixed_ms": fixed}
        lines.append(f"| {pattern} | {a:.1f} ({s1} steps) | {b:.1f} ({s2} steps) | "
                     f"{per_step:.2f} | {fixed:.1f} | {loads} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "relay_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    parallel.close()


if __name__ == "__main__":
    sys.exit(main())

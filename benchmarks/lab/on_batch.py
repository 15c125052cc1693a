"""Cheap loops of calls: what a call costs when the model did not change.

Two measurements on CPU with simulated devices, for the backend of this process
(``KERAS_BACKEND=jax|tensorflow|torch python benchmarks/lab/on_batch.py``):

A. 30 ``train_on_batch`` calls against one ``fit`` over the same 30 batches, kmgpu and
   plain Keras (one device): the ratio loop / fit for each. Target: kmgpu's ratio at
   most 3x plain Keras's.
B. ``for _ in range(10): parallel.fit(x, y, epochs=1)`` against one
   ``parallel.fit(x, y, epochs=10)`` on ``keras.applications.ResNet50(weights=None,
   input_shape=(32, 32, 3))`` with few rows. Target: at most 1.1x.

Each kmgpu row is measured twice in the same run: as kmgpu runs now (the template is
copied in only where it changed) and with every call copying the whole state in, so the table shows what the change buys. Every measurement
runs once first to compile / trace, then is timed (best of ``--repeats``).

Prints a table; no number here is asserted by a test.
"""

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _copy_always(parallel):
    """Make every call copy the template's whole state in (what kmgpu did before)."""
    engine = parallel._engine
    if hasattr(engine, "launcher"):  # torch: forget what the ranks hold before each call
        launcher, launch = engine.launcher, engine.launcher.launch

        def launch_(*args, **kwargs):
            launcher._synced = None
            return launch(*args, **kwargs)

        launcher.launch = launch_
    else:
        engine.same_values = lambda pairs: [False] * len(pairs)


def _best(fn, repeats):
    fn()  # compile / trace / start the pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _mlp(keras, seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def loop_vs_fit(keras, kmgpu, devices, repeats, batch=64, steps=30):
    """Part A: rows of (what, loop s, fit s, ratio)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 64)).astype("float32")
    y = rng.normal(size=(batch * steps, 10)).astype("float32")
    rows = []
    for label in ("plain Keras, 1 device", f"kmgpu, {devices} devices",
                  f"kmgpu, {devices} devices, copy always (before)"):
        model = _mlp(keras)
        model.compile(optimizer="adam", loss="mse")
        runner = model
        if label.startswith("kmgpu"):
            runner = kmgpu.parallelize(model, gpus=devices)
            if "always" in label:
                _copy_always(runner)

        def loop():
            for s in range(steps):
                runner.train_on_batch(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch])

        def fit():
            runner.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        t_loop, t_fit = _best(loop, repeats), _best(fit, repeats)
        rows.append((label, t_loop, t_fit, t_loop / t_fit))
        if hasattr(runner, "close"):
            runner.close()
    return rows


def fits_vs_epochs(keras, kmgpu, devices, repeats, rows=8, epochs=10):
    """Part B: rows of (what, 10 fits s, 1 fit of 10 epochs s, ratio)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(rows,))
    out = []
    for label in (f"kmgpu, {devices} devices", f"kmgpu, {devices} devices, copy always (before)"):
        keras.utils.set_random_seed(1)
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        parallel = kmgpu.parallelize(model, gpus=devices)
        if "always" in label:
            _copy_always(parallel)

        def many():
            for _ in range(epochs):
                parallel.fit(x, y, batch_size=rows, epochs=1, verbose=0)

        def one():
            parallel.fit(x, y, batch_size=rows, epochs=epochs, verbose=0)

        t_many, t_one = _best(many, repeats), _best(one, repeats)
        out.append((label, t_many, t_one, t_many / t_one))
        parallel.close()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--part", choices=("a", "b", "all"), default="all")
    args = parser.parse_args(argv)
    import kmgpu

    kmgpu.simulate_devices(args.devices)
    import keras

    warnings.simplefilter("ignore")  # "only 1 step(s) per epoch" and the like
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        torch.set_num_threads(1)  # as each worker (fork): like for like, and a loaded
        # machine's oversubscribed intra-op threads made plain Keras 20x slower here
    if args.part in ("a", "all"):
        rows = loop_vs_fit(keras, kmgpu, args.devices, args.repeats)
        plain = rows[0][3]
        print(f"\n## A. {backend}: 30 train_on_batch calls vs one fit over the same 30 batches "
              "(MLP 64-512-512-10, batch 64, Adam)\n")
        print("| run | 30 x train_on_batch (s) | fit, 30 steps (s) | loop / fit | vs plain |")
        print("|---|---|---|---|---|")
        for label, t_loop, t_fit, ratio in rows:
            print(f"| {label} | {t_loop:.3f} | {t_fit:.3f} | {ratio:.2f} | {ratio / plain:.2f}x |")
    if args.part in ("b", "all"):
        rows = fits_vs_epochs(keras, kmgpu, args.devices, args.repeats)
        print(f"\n## B. {backend}: 10 x fit(epochs=1) vs fit(epochs=10), ResNet-50 32x32, "
              "8 rows (one step per epoch), Adam\n")
        print("| run | 10 x fit(epochs=1) (s) | fit(epochs=10) (s) | ratio |")
        print("|---|---|---|---|")
        for label, t_many, t_one, ratio in rows:
            print(f"| {label} | {t_many:.2f} | {t_one:.2f} | {ratio:.2f}x |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

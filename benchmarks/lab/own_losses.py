"""What a layer that adds a loss costs when it runs on the global batch
(``kmgpu/engines/global_losses.py``). A script that prints a Markdown table, not a test.

    KERAS_BACKEND=<tensorflow|torch|jax> python benchmarks/lab/own_losses.py [--quick]
        [--devices 4 | --gpus] [--rounds 3] [--rows 8192]

One process, ``kmgpu.parallelize(model, gpus=N)`` on N simulated CPU devices (``--gpus``:
every GPU), an MLP
``in 256 -> 512 relu -> L -> 512 relu -> 10`` (softmax cross-entropy, Adam), where the
layer ``L`` adds ``1e-3 * sum(h**2) / rows``, in two variants of the same loss:

- "keras": Keras's ``ActivityRegularization(l2=1e-3)``: Keras's own layer, a mean over
  rows, computed by each replica on its rows (no all-gather);
- "custom": the same loss from a layer written in the script, which kmgpu runs on the
  global batch on TensorFlow and torch (its input all-gathered, its output cut back).

Both train the same weights (the table gives their relative difference after the timed
calls). Each call is ``fit(epochs=1)`` over 8192 rows (``--rows``) in batches of 256, timed
in the order keras, custom, custom, keras per round after one untimed call of each; the
table gives the medians in ms per step.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def build(variant):
    import keras

    class SquaredActivity(keras.layers.Layer):
        """``ActivityRegularization(l2=1e-3)``'s loss, written outside Keras."""

        def call(self, h):
            rows = keras.ops.cast(keras.ops.shape(h)[0], h.dtype)
            self.add_loss(1e-3 * keras.ops.sum(keras.ops.square(h)) / rows)
            return h

    keras.utils.set_random_seed(1)
    inputs = keras.Input((256,))
    h = keras.layers.Dense(512, activation="relu")(inputs)
    h = (keras.layers.ActivityRegularization(l2=1e-3) if variant == "keras"
         else SquaredActivity())(h)
    h = keras.layers.Dense(512, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    parser.add_argument("--gpus", action="store_true", help="every GPU instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="1 round, 2048 rows")
    args = parser.parse_args()
    import kmgpu

    if not args.gpus:
        kmgpu.simulate_devices(args.devices)
    import keras
    import numpy as np

    from tests.helpers import rel_diff

    rows = 2048 if args.quick else args.rows
    rounds = 1 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 256)).astype("float32")
    y = rng.integers(0, 10, rows)
    models = {v: build(v) for v in ("keras", "custom")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-device note on one GPU
        runs = {v: kmgpu.parallelize(m, gpus=None if args.gpus else args.devices)
                for v, m in models.items()}

    def call(variant):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kmgpu's few-steps note (--quick)
            runs[variant].fit(x, y, batch_size=256, epochs=1, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / (rows // 256) * 1e3

    for variant in ("keras", "custom"):
        call(variant)
    got = {"keras": [], "custom": []}
    for _ in range(rounds):
        for variant in ("keras", "custom", "custom", "keras"):
            got[variant].append(call(variant))
    keras_ms, custom_ms = (statistics.median(got[v]) for v in ("keras", "custom"))
    diff = rel_diff(models["keras"].get_weights(), models["custom"].get_weights())
    own = runs["custom"].describe(print_fn=lambda text: None)
    line = next((s for s in str(own).splitlines() if "own losses" in s), "").strip()
    print(f"\n{keras.backend.backend()}, {runs['custom'].num_replicas} devices, {rows} rows, "
          f"batch 256, medians of {rounds * 2} calls each\n")
    print("| variant | ms/step | vs keras |")
    print("|---|---|---|")
    print(f"| keras (ActivityRegularization, per replica) | {keras_ms:.2f} | 1.00 |")
    print(f"| custom (on the global batch) | {custom_ms:.2f} | {custom_ms / keras_ms:.2f} |")
    print(f"\nweights keras vs custom after {2 + 4 * rounds} fits: relative difference "
          f"{diff:.1e}\ndescribe(): {line}")


if __name__ == "__main__":
    main()

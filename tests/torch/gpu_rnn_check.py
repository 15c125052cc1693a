"""Real-GPU check of the masked GRU/LSTM on cuDNN (run by hand on a CUDA machine, not by
pytest):

    KERAS_BACKEND=torch python tests/torch/gpu_rnn_check.py 2>&1 | tee rnn.log
    grep -c "contiguous chunk" rnn.log   # 0: cuDNN got the weights in its own layout

A masked bidirectional GRU and LSTM over Embedding(mask_zero=True), fitted 2 epochs through
kmgpu's one-GPU step (whose worker's warnings reach this process's output) against plain
Keras on the same GPU (tf32 off for both). Prints the largest relative difference of the
losses and weights; exits 1 above 1e-4.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402


def build(kind, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    rnn = getattr(keras.layers, kind)
    return keras.Sequential([
        keras.Input((40,), dtype="int32"),
        keras.layers.Embedding(500, 32, mask_zero=True),
        keras.layers.Bidirectional(rnn(64, return_sequences=True)),
        keras.layers.Bidirectional(rnn(64)),
        keras.layers.Dense(1),
    ])


def main():
    import kmgpu

    rng = np.random.default_rng(0)
    x = rng.integers(1, 500, (512, 40)).astype("int32")
    for row, n in enumerate(rng.integers(5, 40, 512)):
        x[row, n:] = 0
    y = rng.standard_normal((512, 1)).astype("float32")
    worst = 0.0
    for kind in ("GRU", "LSTM"):
        runs = []
        for parallel in (False, True):
            model = build(kind)
            runner = kmgpu.parallelize(model, gpus=1, tf32=False) if parallel else model
            runner.compile(optimizer="adam", loss="mse")
            hist = runner.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
            runs.append((hist.history["loss"], [w.numpy() for w in model.weights]))
        (loss_a, w_a), (loss_b, w_b) = runs
        diff = max([abs(a - b) / abs(a) for a, b in zip(loss_a, loss_b)] +
                   [float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-6))
                    for a, b in zip(w_a, w_b)])
        print(f"{kind}: losses {loss_a} / {loss_b}; largest relative difference {diff:.2e}")
        worst = max(worst, diff)
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()

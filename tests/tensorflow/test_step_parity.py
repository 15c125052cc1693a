"""TensorFlow, 4 devices against plain Keras on one: what a callback sees after each
batch.

45 rows in batches of 12: the last batch of each epoch (9 rows) splits unevenly over
the 4 replicas, which is where a per-replica mean differs from one device's.
"""

import contextlib

import keras
import numpy as np

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

ROWS, BATCH = 45, 12


class BatchLogs(keras.callbacks.Callback):
    """The logs of every train and test batch, in order (a LossHistory)."""

    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))


def _curves(logs):
    return {key: [entry[key] for entry in logs] for key in logs[0]}


def test_every_batch_logs_equal_one_device():
    """fit (2 epochs) and evaluate: each batch's loss and metric, the uneven last batch
    included, equal one device's; so do the weights and the History."""
    x, y = data("mlp", ROWS)
    runs = {}
    for name in ("plain", "kmgpu"):
        model = mlp(seed=2)
        runner = model if name == "plain" else kmgpu.parallelize(model, gpus=4)
        runner.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        logs = BatchLogs()
        with few_steps() if name == "kmgpu" else contextlib.nullcontext():
            history = runner.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                 verbose=0, callbacks=[logs])
        runner.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[logs])
        runs[name] = (model, history.history, logs)
    (plain, plain_history, plain_logs), (model, history, logs) = runs["plain"], runs["kmgpu"]
    assert len(logs.train) == len(plain_logs.train) == 8
    for key, curve in _curves(plain_logs.train).items():
        np.testing.assert_allclose(_curves(logs.train)[key], curve, rtol=1e-6, atol=1e-7)
    for key, curve in _curves(plain_logs.test).items():
        np.testing.assert_allclose(_curves(logs.test)[key], curve, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history["loss"], plain_history["loss"], rtol=1e-6)
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-5

"""TensorFlow, 4 devices against plain Keras on one: what a callback sees after each
batch, and a loss-scale optimizer whose gradients overflow on one replica only.

45 rows in batches of 12: the last batch of each epoch (9 rows) splits unevenly over
the 4 replicas, which is where a per-replica mean differs from one device's.
"""

import contextlib

import keras
import numpy as np

import kmgpu
from tests.helpers import batch_logs, data, few_steps, mlp, rel_diff

ROWS, BATCH = 45, 12


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
        logs = batch_logs()
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


def test_loss_scale_skips_a_step_that_overflows_on_another_replica():
    """mixed_float16: row 5 (replica 1's block of the first batch) has a target whose
    loss gradient overflows float16 at the scale Keras starts from. One device skips that
    step and halves the scale (every epoch); 4 devices must do the same, not apply the
    overflowed replica's inf (NaN weights from then on)."""
    x, y = data("mlp", ROWS)
    y[5] = 3000.0
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        runs = {}
        for name in ("plain", "kmgpu"):
            keras.utils.set_random_seed(3)
            # float32 weights (parity to float32 rounding), a float16 output: the float32
            # loss gradient overflows where it is cast to float16
            model = keras.Sequential([
                keras.Input((5,)),
                keras.layers.Dense(16, activation="relu", dtype="float32"),
                keras.layers.Dense(1, dtype="float32"),
                keras.layers.Activation("linear"),
            ])
            runner = model if name == "plain" else kmgpu.parallelize(model, gpus=4)
            runner.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
            with few_steps() if name == "kmgpu" else contextlib.nullcontext():
                history = runner.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                     verbose=0)
            runs[name] = (model, history.history["loss"])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    (plain, plain_loss), (model, loss) = runs["plain"], runs["kmgpu"]
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(loss).all()
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert float(model.optimizer.dynamic_scale.numpy()) == \
        float(plain.optimizer.dynamic_scale.numpy()) == 2.0 ** 13  # two skipped steps

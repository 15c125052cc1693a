"""kmgpu's packed JAX train step (``kmgpu/engines/jax/packed.py``, issue 22): the model
state travels as a few flat arrays; weights and History are plain Keras's, on one
device and on 4 simulated devices; ``KMGPU_JAX_FAST=0`` switches it off; callbacks
that need every step still see every step, and what they do to the weights mid-epoch
counts as in plain Keras."""

import re

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

ONE_DEVICE = "kmgpu: .*one device"


class StepWatch:
    """Counts every train step; at step ``poke`` reads the weights through
    ``self.model`` (Keras syncs its state) and halves the last layer's kernel."""

    def __new__(cls, poke=4):
        import keras

        class _Watch(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.steps, self.seen = 0, []

            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1
                self.seen.append(float(logs["loss"]))
                if self.steps == poke:
                    layer = self.model.layers[-1]
                    kernel, bias = layer.get_weights()
                    layer.set_weights([kernel * 0.5, bias])

        return _Watch()


def _plain(build, x, y, callbacks=(), **fit):
    model = build()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = model.fit(x, y, shuffle=False, verbose=0, callbacks=list(callbacks), **fit)
    return model, history.history


def _one_device(build):
    model = build()
    with pytest.warns(UserWarning, match=ONE_DEVICE):
        parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model, parallel


def _same_history(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)


@pytest.fixture
def packed(monkeypatch):
    monkeypatch.setenv("KMGPU_JAX_FAST", "packed")  # from the first step, no measuring


def test_one_device_packed_step_trains_as_plain_fit(packed):
    x, y = data("mlp", 103)  # 11 steps of 10, the last one of 3 rows
    fit = dict(batch_size=10, epochs=2, validation_data=(x[:21], y[:21]))
    plain, plain_history = _plain(mlp, x, y, **fit)
    model, parallel = _one_device(mlp)
    history = parallel.fit(x, y, shuffle=False, verbose=0, **fit).history
    assert "the model state as 2 flat array(s) instead of 18" in parallel.describe()
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-6
    _same_history(plain_history, history)
    assert model.train_function is None  # the model's own is back: plain fit is Keras's
    # recompiled (another loss): a new packed step, not the cached one
    for m in (plain, parallel):
        m.compile(optimizer="sgd", loss="mae")
    h1 = plain.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history
    h2 = parallel.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-6
    _same_history(h1, h2)


def test_switched_off_runs_keras_own_step(monkeypatch):
    monkeypatch.setenv("KMGPU_JAX_FAST", "0")
    x, y = data("mlp", 40)
    plain, plain_history = _plain(mlp, x, y, batch_size=4, epochs=1)
    model, parallel = _one_device(mlp)
    history = parallel.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    assert "Keras's own jitted step (KMGPU_JAX_FAST=0)" in parallel.describe()
    assert parallel._engine._packed.function is None  # never built
    assert rel_diff(plain.get_weights(), model.get_weights()) == 0.0
    _same_history(plain_history, history)


def test_callbacks_see_every_step_and_their_weight_changes_count(packed):
    x, y = data("mlp", 57)  # 12 steps of 5 per epoch, the last one of 2 rows
    plain_watch, watch = StepWatch(), StepWatch()
    plain, _ = _plain(mlp, x, y, callbacks=[plain_watch], batch_size=5, epochs=2)
    model, parallel = _one_device(mlp)
    parallel.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, callbacks=[watch])
    assert watch.steps == plain_watch.steps == 24
    np.testing.assert_allclose(watch.seen, plain_watch.seen, rtol=1e-6)
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-6


def test_four_devices_packed_step_trains_as_one_device(packed):
    x, y = data("mlp", 51)  # 13 steps of 4 (one row per device), the last of 3 rows
    plain = mlp()
    plain.compile(optimizer="adam", loss="mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert re.search(r"the model state as \d flat array\(s\) instead of \d\d", parallel.describe())
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-5


def test_measures_both_steps_then_keeps_the_faster():
    from kmgpu.engines.jax import packed

    x, y = data("mlp", 64)  # 16 steps of 4: 8 with Keras's step, 8 packed
    plain, plain_history = _plain(mlp, x, y, batch_size=4, epochs=2)
    model, parallel = _one_device(mlp)
    assert "whichever measures faster in the first fit" in parallel.describe()
    history = parallel.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    step = parallel._engine._packed.function
    assert set(step.measured) == {"keras", "packed"}
    assert step.choice == min(step.measured, key=step.measured.get)
    assert re.search(r"measured faster \(keras [\d.]+ ms/step, packed [\d.]+ ms/step",
                     parallel.describe())
    assert rel_diff(plain.get_weights(), model.get_weights()) <= 1e-6
    _same_history(plain_history, history)
    assert packed.PackedTrainFunction.WARM + packed.PackedTrainFunction.WINDOW == 8

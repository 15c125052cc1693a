"""batch="per_replica", the linear learning-rate scaling rule and warm-up."""

import re

import numpy as np
import pytest

import kmgpu
from kmgpu import sine
from kmgpu.engines import lr
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5
N = 4


def _one_device(optimizer, x, y, batch_size, epochs, callbacks=()):
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def test_per_replica_batch_without_scaling_equals_one_device_at_n_times_the_batch():
    import keras

    x, y = data("mlp", 70)
    ref, _ = _one_device(keras.optimizers.SGD(0.01), x, y, batch_size=8 * N, epochs=2)
    model = mlp()
    with pytest.warns(UserWarning, match="scale_lr=False"):
        parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica", scale_lr=False)
        parallel.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    pred = parallel.predict(x, batch_size=8, verbose=0)
    assert pred.shape == (70, 1)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_scaled_rate_with_warmup_equals_one_device_with_the_same_ramp(name):
    import keras

    base, warmup, epochs = 0.01, 2, 4
    make = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[name]
    x, y = data("mlp", 96)
    ramp = keras.callbacks.LearningRateScheduler(
        lambda epoch, _: base * lr.ramp(N, warmup, epoch))
    ref, _ = _one_device(make(base), x, y, batch_size=8 * N, epochs=epochs, callbacks=[ramp])

    model = mlp()
    optimizer = make(base)
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica", warmup_epochs=warmup)
    parallel.compile(optimizer=optimizer, loss="mse")
    with few_steps():
        history = parallel.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    # the recorded rate follows the linear ramp base -> N x base over `warmup` epochs
    np.testing.assert_allclose(history.history["learning_rate"],
                               [base, base * 2.5, base * N, base * N], rtol=1e-6)
    # the user's optimizer keeps its base rate: a second fit does not scale twice
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(base)
    parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, initial_epoch=0)
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(base)
    assert optimizer.get_config()["learning_rate"] == pytest.approx(base)


def test_callbacks_that_change_the_rate_work_in_unscaled_units():
    import keras

    x, y = data("mlp", 64)
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.02 / (2 ** epoch))
    ref, _ = _one_device(keras.optimizers.SGD(0.02), x, y, batch_size=8 * N, epochs=3,
                         callbacks=[keras.callbacks.LearningRateScheduler(
                             lambda epoch, rate: N * 0.02 / (2 ** epoch))])
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica")
    parallel.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    with few_steps():
        history = parallel.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                               callbacks=[halve])
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    np.testing.assert_allclose(history.history["learning_rate"], [0.08, 0.04, 0.02], rtol=1e-6)
    # the user's optimizer ends with the base rate the user's callback set last
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.005)


def test_reduce_lr_on_plateau_lowers_the_base_rate():
    import keras

    x, y = data("mlp", 64)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica")
    parallel.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=1e9)  # every epoch is a plateau
    with few_steps():
        history = parallel.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                               callbacks=[plateau])
    # ReduceLROnPlateau first reduces at the end of epoch 1 (epoch 0 improves on inf)
    np.testing.assert_allclose(history.history["learning_rate"], [0.04, 0.04, 0.02], rtol=1e-6)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.0025)


def test_learning_rate_schedule_is_scaled():
    import keras

    x, y = data("mlp", 64)

    def schedule():
        return keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.9)

    class Times(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule()(step) * N

    ref, _ = _one_device(keras.optimizers.SGD(Times()), x, y, batch_size=8 * N, epochs=2)
    model = mlp()
    optimizer = keras.optimizers.SGD(schedule())
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica")
    parallel.compile(optimizer=optimizer, loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert isinstance(optimizer._learning_rate, keras.optimizers.schedules.ExponentialDecay)


def test_sine_per_replica_with_scaled_rate():
    """kmgpu.sine's model and data, batch 8 per replica, Adam(0.005) scaled x4, 30 epochs
    (not Keras's default rate for sine.EPOCHS = 100: a third of the steps); test RMSE
    after 30 / 35 / 40 epochs 5.18 / 5.10 / 5.11 (JAX), 5.01 / 5.07 / 4.98 (torch),
    4.87 / 4.87 / 4.93 (TensorFlow)."""
    import keras

    (x_tr, y_tr), (x_te, y_te), scale = sine.data()
    model = sine.model()
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica")
    parallel.compile(optimizer=keras.optimizers.Adam(0.005), loss="mse")
    with pytest.warns(UserWarning, match="step"):
        parallel.fit(x_tr, y_tr, batch_size=sine.BATCH, epochs=30, shuffle=False, verbose=0)
    rmse = sine.rmse(model, x_te, y_te, scale)
    print(f"sine per-replica batch 8 x {N}, lr x{N}: test RMSE {rmse:.3f}")
    assert rmse <= 6.0


def test_describe_states_the_plan(capsys):
    import keras

    x, y = data("mlp", 100)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=N, batch="per_replica", warmup_epochs=3)
    parallel.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=1)
    out = capsys.readouterr().out
    text = parallel.describe()
    # a verbose fit prints the plan first; only the memory line knows more after the fit
    # (the optimizer's bytes, once it is built)
    before = [ln for ln in text.splitlines() if not ln.lstrip().startswith("memory/device")]
    assert "\n".join(before) in out.replace(
        next(ln for ln in out.splitlines() if "memory/device" in ln) + "\n", ""), \
        "a verbose fit prints the plan first"
    assert "optimizer state: bytes known once the optimizer is built" in out
    assert re.search(r"memory/device .* optimizer state [\d.]+ (B|KiB|MiB) ", text), text
    params = model.count_params() * 4
    for expected in [f"devices            {N}:", "batch policy       per_replica",
                     "global batch       20", "per-replica batch  5",
                     "steps/epoch        5 (100 samples)",
                     "learning rate      x4 (linear scaling rule), warm-up from x1 over 3 epoch(s)",
                     f"all-reduce/step    {params * 2 * (N - 1) / N:.0f} B (params {params} B"]:
        assert expected in text, (expected, text)
    assert "BatchNorm" not in text, "a model without BatchNormalization gets no BatchNorm line"


def test_bad_policy_values_leave_the_model_alone():
    model = mlp()
    before = model.get_weights()
    for kwargs, error in [({"batch": "globall"}, ValueError), ({"warmup_epochs": -1}, ValueError),
                          ({"scale_lr": "yes"}, TypeError), ({"warmup_epochs": 1.5}, TypeError),
                          ({"batch": "global", "warmup_epochs": 2}, ValueError)]:
        with pytest.raises(error):
            kmgpu.parallelize(model, gpus=N, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))

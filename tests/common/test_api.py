"""The contract around parity: inputs Keras accepts, state kept in the user's model,
bad input refused with the model untouched."""

import functools
import json

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


def _snapshot(model):
    return [w.copy() for w in model.get_weights()], json.dumps(model.get_config(), default=repr)


def _unchanged(model, snap):
    weights, config = snap
    assert json.dumps(model.get_config(), default=repr) == config
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


@pytest.mark.parametrize(
    "gpus,error,words",
    [
        (0, ValueError, "at least 1"),
        (-2, ValueError, "at least 1"),
        (5, ValueError, "more devices than exist"),
        (1.5, TypeError, "int"),
        ("every", TypeError, "pass None \\(or 'all', -1\\) for all"),
        ("0,1", TypeError, "a list of ids"),
        (True, TypeError, "None, an int"),
        ([0, 0], ValueError, "twice"),
        ([0, 9], ValueError, "does not exist"),
        ([], ValueError, "names no device"),
        ({"second": 1}, ValueError, "'main'"),
        ({"main": "0"}, TypeError, "ints"),
    ],
)
def test_bad_gpus(gpus, error, words):
    model = mlp()
    snap = _snapshot(model)
    with pytest.raises(error, match=words):
        kmgpu.parallelize(model, gpus=gpus)
    _unchanged(model, snap)


def test_gpus_forms():
    assert kmgpu.devices() == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert kmgpu.parallelize(mlp(), gpus=None).num_replicas == 4
    for every in ("all", "auto", "ALL", -1, "-1"):  # what Keras / Lightning users type
        assert kmgpu.parallelize(mlp(), gpus=every).num_replicas == 4, every
    assert kmgpu.parallelize(mlp(), gpus=[0, 2]).num_replicas == 2
    parallel = kmgpu.parallelize(mlp(), gpus={"main": 3, "second": 1})
    assert parallel._engine.device_names == ["cpu:3", "cpu:1"]


def test_bad_models_and_options():
    import keras

    with pytest.raises(TypeError, match="keras.Model"):
        kmgpu.parallelize(keras.layers.Dense(3))
    with pytest.raises(TypeError, match="keras.Model"):
        kmgpu.parallelize("model.keras")
    class Sub(keras.Model):  # unbuilt and not a Sequential: kmgpu cannot build it alone
        def call(self, x):
            return x

        def get_config(self):
            return {}

    with pytest.raises(ValueError, match="built"):
        kmgpu.parallelize(Sub())
    model = mlp()
    snap = _snapshot(model)
    with pytest.raises(TypeError, match="unexpected keyword"):
        kmgpu.parallelize(model, gpu=2)
    with pytest.raises(ValueError, match="batch='global'"):
        kmgpu.parallelize(model, batch="globall")
    with pytest.raises(TypeError, match="scale_lr"):
        kmgpu.parallelize(model, scale_lr="yes")
    with pytest.raises(ValueError, match="warmup_epochs"):
        kmgpu.parallelize(model, batch="per_replica", warmup_epochs=-1)
    with pytest.raises(TypeError, match="sync_batchnorm"):
        kmgpu.parallelize(model, sync_batchnorm=1)
    with pytest.raises(ValueError, match="reset_states"):
        kmgpu.parallelize(model, reset_states="batch")
    with pytest.raises(TypeError, match="drop_remainder"):
        kmgpu.parallelize(model, drop_remainder="yes")
    parallel = kmgpu.parallelize(model, gpus=2)
    x, y = data("mlp", 8)
    with pytest.raises(ValueError, match="compile"):
        parallel.fit(x, y)
    with pytest.raises(ValueError, match="compile"):
        parallel.evaluate(x, y)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="keras.Model.fit"):
        parallel.fit(x, y, epochz=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        parallel.fit(x, y, batch_size=0)
    _unchanged(model, snap)


def test_one_device_says_so_and_works():
    x, y = data("mlp", 30)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = mlp()
    with pytest.warns(UserWarning, match="one device"):
        parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL


def test_template_compiled_before_wrapping_and_optimizer_state_carries_over(tmp_path):
    """Two fits of one epoch == one fit of two epochs (Adam moments and step count
    carry over), and the user's own optimizer holds that state for saving. 2 devices:
    what carries over is the same on any count."""
    import keras

    x, y = data("mlp", 40)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    model = mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    parallel = kmgpu.parallelize(model, gpus=2)
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    history = parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert int(model.optimizer.iterations.numpy()) == 10
    assert set(history.history) == {"loss", "mae"}
    assert model.history is history

    path = tmp_path / "m.keras"
    parallel.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert int(loaded.optimizer.iterations.numpy()) == 10


def test_changes_to_the_model_between_calls_are_picked_up():
    x, y = data("mlp", 16)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.predict(x, verbose=0)
    zeros = [np.zeros_like(w) for w in model.get_weights()]
    model.set_weights(zeros)
    np.testing.assert_array_equal(parallel.predict(x, verbose=0), np.zeros((16, 1)))
    # recompiling the user's model directly also reaches the replicas
    model.compile(optimizer="sgd", loss="mae")
    loss = parallel.evaluate(x, y, verbose=0)
    assert loss == pytest.approx(float(np.mean(np.abs(y))), rel=1e-5)


class _StopAt:
    """A callback that raises at the start of an epoch."""

    def __new__(cls, epoch, error):
        import keras

        class Stop(keras.callbacks.Callback):
            def on_epoch_begin(self, e, logs=None):
                if e == epoch:
                    raise error

        return Stop()


@functools.lru_cache(maxsize=None)
def _one_epoch_on_one_device():
    """The weights plain Keras has after epoch 1 of the interrupted fit below, made once
    for both of its cases."""
    x, y = data("mlp", 32)
    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return ref.get_weights()


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("callback failed")])
def test_interrupted_fit_keeps_progress(error):
    x, y = data("mlp", 32)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.raises(type(error)), few_steps():
        parallel.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                     callbacks=[_StopAt(1, error)])
    assert rel_diff(_one_epoch_on_one_device(), model.get_weights()) <= TOL


def test_keras_fit_features():
    """validation_split, validation_data, sample_weight, callbacks and History keys."""
    import keras

    x, y = data("mlp", 50)
    w = np.linspace(0.5, 1.5, 50).astype("float32")
    kwargs = dict(batch_size=12, epochs=2, shuffle=False, verbose=0, validation_split=0.2,
                  sample_weight=w)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
    ref_hist = ref.fit(x, y, **kwargs)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    seen = []
    cb = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(dict(logs)))
    with few_steps():
        hist = parallel.fit(x, y, callbacks=[cb], **kwargs)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert set(hist.history) == {"loss", "mae", "val_loss", "val_mae"}
    for key, values in ref_hist.history.items():
        np.testing.assert_allclose(hist.history[key], values, rtol=1e-5)
    assert len(seen) == 2 and "val_loss" in seen[0]
    vx, vy = data("mlp", 9, seed=3)
    hist = parallel.fit(x, y, validation_data=(vx, vy), batch_size=12, epochs=1, verbose=0)
    assert hist.history["val_loss"][0] == pytest.approx(
        model.evaluate(vx, vy, verbose=0, return_dict=True)["loss"], rel=1e-5)


def test_multi_input_multi_output_dict_model():
    import keras

    keras.utils.set_random_seed(2)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(8, activation="tanh")(h)
    out1 = keras.layers.Dense(1, name="out1")(h)
    out2 = keras.layers.Dense(2, name="out2")(h)
    build = lambda: keras.Model({"a": a, "b": b}, {"out1": out1, "out2": out2})  # noqa: E731
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(33, 3)).astype("float32"),
         "b": rng.normal(size=(33, 2)).astype("float32")}
    y = {"out1": rng.normal(size=(33, 1)).astype("float32"),
         "out2": rng.normal(size=(33, 2)).astype("float32")}
    ref = build()
    init = ref.get_weights()
    model = keras.models.clone_model(ref)
    model.set_weights(init)
    loss = {"out1": "mse", "out2": "mae"}
    ref.compile(optimizer="sgd", loss=loss)
    ref.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="sgd", loss=loss)
    with few_steps():
        parallel.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    pred = parallel.predict(x, batch_size=10, verbose=0)
    assert pred["out2"].shape == (33, 2)
    np.testing.assert_allclose(pred["out1"], ref.predict(x, verbose=0)["out1"], rtol=1e-5, atol=1e-6)


def test_pass_through_and_describe(capsys):
    x, y = data("mlp", 40)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    assert parallel.layers == model.layers
    assert parallel.count_params() == model.count_params()
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    capsys.readouterr()
    text = parallel.describe()
    assert capsys.readouterr().out == text + "\n"  # printed, as summary() prints
    assert text.startswith("kmgpu plan") and repr(text).startswith("<kmgpu plan")
    params = model.count_params() * 4
    for expected in ["devices            4: cpu:0, cpu:1, cpu:2, cpu:3", "global batch       8",
                     "per-replica batch  2", "steps/epoch        5 (40 samples)",
                     f"params {params} B"]:
        assert expected in text, (expected, text)
    assert "kmgpu.ParallelModel" in repr(parallel)

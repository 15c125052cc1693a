"""What real training scripts also do, on 2 devices as on one (plain Keras): gradient
clipping, every Keras loss reduction, classes the script defines without registering
them. Same initial weights, data and global batch, shuffle=False; a global batch of 5
does not split evenly over 2 devices and the last batch (1 row) leaves one replica
without rows; batches of 8 split evenly but the last one (5 rows) does not.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff

TOL = 1e-5
DEVICES = 2
ROWS, BATCH = 51, 5  # 11 steps per epoch: 3 + 2 rows each, the last one 1 row (1 + 0)
EVEN = dict(rows=77, batch=8)  # batches of 4 rows per device, the last one 5 (3 + 2)


def _data(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2)) + 0.1 * rng.normal(size=(rows, 2))).astype("float32")
    return x, y, rng.uniform(0.2, 2.0, size=(rows,)).astype("float32")


def _mlp(*layers):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             *layers, keras.layers.Dense(2)])


def _run(target, model, compile_kwargs, x, y, sw, batch, evaluate=True):
    target.compile(**compile_kwargs)
    history = target.fit(x, y, sample_weight=sw, batch_size=batch, epochs=1, shuffle=False,
                         verbose=0)
    scores = (target.evaluate(x, y, sample_weight=sw, batch_size=batch, verbose=0,
                              return_dict=True) if evaluate else {})
    return model.get_weights(), history.history, scores


def _same_as_one_device(make, compile_kwargs, rows=ROWS, batch=BATCH, weighted=True,
                        evaluate=True, parallel_kwargs=None):
    """fit (+ evaluate) on one device and through kmgpu on 2: the same weights, History
    and evaluate; returns the one-device History."""
    x, y, sw = _data(rows)
    sw = sw if weighted else None
    model = make()
    before = model.get_weights()
    reference = make()
    ref = _run(reference, reference, compile_kwargs(), x, y, sw, batch, evaluate)
    got = _run(kmgpu.parallelize(model, gpus=DEVICES), model,
               dict(compile_kwargs(), **(parallel_kwargs or {})), x, y, sw, batch, evaluate)
    assert rel_diff(before, got[0]) > 1e-3, "the user's model did not train"
    assert rel_diff(ref[0], got[0]) <= TOL
    assert sorted(ref[1]) == sorted(got[1])
    for key in ref[1]:
        np.testing.assert_allclose(got[1][key], ref[1][key], rtol=TOL, err_msg=key)
    assert sorted(ref[2]) == sorted(got[2])
    for key in ref[2]:
        np.testing.assert_allclose(got[2][key], ref[2][key], rtol=TOL, err_msg=key)
    return ref[1]


# -- 1. gradient clipping: the clip sees the whole batch's gradient ---------------------
@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.05},
                                  {"clipvalue": 0.01}], ids=lambda c: next(iter(c)))
def test_clipping_equals_one_device(clip):
    """Even batches and an uneven last one (``EVEN``); the loss reduces by "mean"."""
    _same_as_one_device(_mlp, lambda: dict(
        optimizer=keras.optimizers.Adam(0.01, **clip),
        loss=keras.losses.MeanSquaredError(reduction="mean")), weighted=False, evaluate=False,
        **EVEN)


# -- 2. every loss reduction, and a plain function -------------------------------------
def plain_mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", None, "function"])
def test_loss_reduction_equals_one_device(reduction):
    """The default "sum_over_batch_size" is the loss of the other tests here and of
    test_parity; "mean" (the same in Keras) the clipping tests'."""
    def compile_kwargs():
        loss = plain_mse if reduction == "function" else keras.losses.MeanSquaredError(
            reduction=reduction)
        return dict(optimizer=keras.optimizers.SGD(0.02), loss=loss)

    if reduction is None and keras.backend.backend() != "tensorflow":
        # one device cannot take the gradient of a loss per row here: nor can kmgpu
        x, y, sw = _data()
        reference = _mlp()
        reference.compile(**compile_kwargs())
        with pytest.raises(Exception) as plain:
            reference.fit(x, y, sample_weight=sw, batch_size=BATCH, verbose=0)
        model = _mlp()
        parallel = kmgpu.parallelize(model, gpus=DEVICES)
        parallel.compile(**compile_kwargs())
        with pytest.raises(type(plain.value)):
            parallel.fit(x, y, sample_weight=sw, batch_size=BATCH, verbose=0)
        return
    _same_as_one_device(_mlp, compile_kwargs)


def test_summed_loss_and_clipping_in_torchs_split_step():
    """torch's compile(jit_compile=True) trains through kmgpu's split step (captured as
    CUDA graphs on a GPU, eager on a CPU): the same rule weighs it, against plain
    Keras's eager step (its jit_compile is torch.compile). Elsewhere: a summed loss
    with clipping, as compiled by default."""
    torch = keras.backend.backend() == "torch"
    _same_as_one_device(_mlp, lambda: dict(
        optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05),
        loss=keras.losses.MeanSquaredError(reduction="sum")),
        parallel_kwargs={"jit_compile": True} if torch else None, **EVEN)


def _two_outputs():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(1, name="a")(h),
                                keras.layers.Dense(1, name="b")(h)])


def test_two_outputs_summed_equal_one_device():
    x, y, sw = _data(EVEN["rows"])
    targets = [y[:, :1], y[:, 1:]]
    model = _two_outputs()
    before = model.get_weights()

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.SGD(0.02), loss_weights=[1.0, 0.5],
                    loss=[keras.losses.MeanSquaredError(reduction="sum")] * 2)

    reference = _two_outputs()
    ref = _run(reference, reference, compile_kwargs(), x, targets, sw, EVEN["batch"])
    got = _run(kmgpu.parallelize(model, gpus=DEVICES), model, compile_kwargs(), x, targets, sw,
               EVEN["batch"])
    assert rel_diff(before, got[0]) > 1e-3
    assert rel_diff(ref[0], got[0]) <= TOL
    for key in ("loss", "a_loss", "b_loss"):
        np.testing.assert_allclose(got[1][key], ref[1][key], rtol=TOL, err_msg=key)
        np.testing.assert_allclose(got[2][key], ref[2][key], rtol=TOL, err_msg=key)


def test_outputs_with_mixed_reductions_equal_one_device_or_are_refused():
    """JAX runs the global batch as one computation: any mix equals one device. TF and
    torch weigh each replica's loss by one rule: a mix is refused before any work."""
    x, y, sw = _data()
    targets = [y[:, :1], y[:, 1:]]

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.SGD(0.02), loss=[
            keras.losses.MeanSquaredError(reduction="sum"), "mse"])

    model = _two_outputs()
    before = model.get_weights()
    parallel = kmgpu.parallelize(model, gpus=DEVICES)
    if keras.backend.backend() == "jax":
        reference = _two_outputs()
        ref = _run(reference, reference, compile_kwargs(), x, targets, sw, BATCH, False)
        got = _run(parallel, model, compile_kwargs(), x, targets, sw, BATCH, False)
        assert rel_diff(ref[0], got[0]) <= TOL
        return
    parallel.compile(**compile_kwargs())
    with pytest.raises(ValueError, match="kmgpu: the model's losses reduce differently"):
        parallel.fit(x, targets, sample_weight=sw, batch_size=BATCH, verbose=0)
    assert rel_diff(before, model.get_weights()) == 0
    assert not model.optimizer.built


# -- 3. classes and functions the script defines, unregistered --------------------------
class RMSEOfProb(keras.metrics.Metric):
    def __init__(self, name="rmse_of_prob", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_weight(shape=(), initializer="zeros", name="total")
        self.count = self.add_weight(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = keras.ops.square(keras.ops.sigmoid(y_pred) - keras.ops.sigmoid(y_true))
        self.total.assign_add(keras.ops.sum(error))
        self.count.assign_add(keras.ops.cast(keras.ops.size(error), "float32"))

    def result(self):
        return keras.ops.sqrt(self.total / self.count)


class HalfAbsolute(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return 0.5 * keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


class Scale(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


class Regressor(keras.Sequential):
    """A Sequential subclass: Keras clones it (clone_model compiles the clone from the
    compile config), then kmgpu makes it again from its config."""

    def __init__(self, layers=None, units=8, **kwargs):
        super().__init__(layers, **kwargs)
        self.units = units

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _regressor():
    keras.utils.set_random_seed(1)
    return Regressor([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), Scale(),
                      keras.layers.Dense(2)])


def test_script_defined_classes_equal_one_device():
    """A Model subclass holding a Layer subclass, a Loss subclass, a Metric subclass,
    none registered."""
    history = _same_as_one_device(_regressor, lambda: dict(
        optimizer="adam", loss=HalfAbsolute(), metrics=[RMSEOfProb()]), evaluate=False,
        **EVEN)
    assert "rmse_of_prob" in history


# -- 4. what a config does not carry: the replicas run the user's own objects ----------
SHIFT = 0.25  # a global the Lambda's function reads


def _within(y_true, y_pred, tolerance=0.5):
    return keras.ops.cast(keras.ops.abs(y_true - y_pred) < tolerance, "float32")


class Within(keras.metrics.MeanMetricWrapper):
    """A metric whose config drops an argument, as Keras's own ``Huber`` loss does."""

    def __init__(self, tolerance=0.5, name="within", **kwargs):
        super().__init__(_within, name=name, tolerance=tolerance, **kwargs)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


def _with_lambdas():
    factor = 1.5  # a closure

    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Lambda(lambda t: keras.ops.tanh(t) * factor + SHIFT),
        keras.layers.Dense(2)])


def test_lambda_layers_and_dropped_config_arguments_equal_one_device():
    """A Lambda layer with a Python lambda (a closure and a global), ``Huber(delta=0.2)``
    (whose config drops delta) and a metric whose config drops its tolerance train as
    the user made them: from their configs they would be refused (safe mode) or run
    with the defaults (delta 1.0, tolerance 0.5)."""
    history = _same_as_one_device(_with_lambdas, lambda: dict(
        optimizer="adam", loss=keras.losses.Huber(delta=0.2),
        metrics=[Within(tolerance=2.0)]), **EVEN)
    rebuilt = Within.from_config(Within(tolerance=2.0).get_config())
    rebuilt.update_state(np.zeros((4, 2)), np.ones((4, 2)))
    assert float(rebuilt.result()) == 0.0  # what the replicas would count from the config
    assert history["within"][0] > 0.5

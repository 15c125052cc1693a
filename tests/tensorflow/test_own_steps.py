"""TensorFlow: what ordinary Keras scripts do around the train and test steps gives one
device's numbers on 4 replicas: a model whose only loss is add_loss, a kernel
regularizer with a layer's add_loss, a custom test_step as keras.io's guide writes it,
compile(steps_per_execution=4) over several epochs, predict_on_batch as the first call
on a never-compiled model, use_ema with ema_overwrite_frequency. 78 rows, batch 8: 10
steps per epoch, the last batch (6 rows) leaves one replica of 4 without rows (use_ema,
whose averages are of variables, not rows: 2 devices, half the tracing).
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff

TOL = 1e-5
ROWS, BATCH = 78, 8


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


class MeanSquareLoss(keras.layers.Layer):
    """A layer's own add_loss: a mean over its rows, as an activity regularizer."""

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


class OnlyAddLoss(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        out = self.dense(inputs)
        self.add_loss(keras.ops.mean(keras.ops.square(out - 1.0)))
        return out


class GuideTestStep(keras.Sequential):
    """test_step as keras.io's "Customizing what happens in evaluate()" writes it."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _mlp(cls=keras.Sequential, extra=()):
    keras.utils.set_random_seed(1)
    return cls([keras.Input((5,)), keras.layers.Dense(8, activation="relu",
                                                     kernel_regularizer="l2"),
                *extra, keras.layers.Dense(1)])


def _only_add_loss():
    keras.utils.set_random_seed(1)
    model = OnlyAddLoss()
    model(np.zeros((1, 5), "float32"))
    return model


CASES = {  # name: (model, compile arguments, fit arguments, devices)
    "add_loss_only": (_only_add_loss, lambda: dict(optimizer=keras.optimizers.SGD(0.05)),
                      dict(y=None), 4),
    "regularizer_and_add_loss": (lambda: _mlp(extra=[MeanSquareLoss()]),
                                 lambda: dict(optimizer=keras.optimizers.SGD(0.05),
                                              loss="mse"), {}, 4),
    "guide_test_step": (lambda: _mlp(GuideTestStep),
                        lambda: dict(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                                     metrics=["mae"]), {}, 4),
    "steps_per_execution": (_mlp, lambda: dict(optimizer=keras.optimizers.SGD(0.05),
                                               loss="mse", steps_per_execution=4), {}, 4),
    "ema_overwrite": (_mlp, lambda: dict(optimizer=keras.optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=3), loss="mse"), {}, 2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, compile_kwargs, fit_kwargs, gpus = CASES[request.param]
    x, y = _data()
    out = {}
    for name in ("one", "kmgpu"):
        model = make()
        before = model.get_weights()
        target = model if name == "one" else kmgpu.parallelize(model, gpus=gpus)
        target.compile(**compile_kwargs())
        history = target.fit(x, fit_kwargs.get("y", y), batch_size=BATCH, epochs=2,
                             shuffle=False, verbose=0)
        scores = (target.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
                  if "y" not in fit_kwargs else {})
        out[name] = dict(before=before, after=model.get_weights(), history=history.history,
                         scores=scores, steps=int(model.optimizer.iterations.numpy()))
    return request.param, out


def test_trains_as_on_one_device(case):
    name, out = case
    assert rel_diff(out["one"]["before"], out["one"]["after"]) > 1e-3, name
    assert rel_diff(out["one"]["after"], out["kmgpu"]["after"]) <= TOL, name
    assert out["kmgpu"]["steps"] == out["one"]["steps"] == 20, name


def test_reports_as_on_one_device(case):
    name, out = case
    for part in ("history", "scores"):
        one, got = out["one"][part], out["kmgpu"][part]
        assert sorted(one) == sorted(got), name
        for key in one:
            np.testing.assert_allclose(got[key], one[key], rtol=TOL, err_msg=f"{name} {key}")


def test_predict_on_batch_first_on_a_never_compiled_model():
    x, _ = _data()
    expected = _mlp().predict_on_batch(x[:10])
    got = kmgpu.parallelize(_mlp(), gpus=4).predict_on_batch(x[:10])
    np.testing.assert_allclose(got, expected, rtol=TOL, atol=1e-6)

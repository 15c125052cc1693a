"""A model's own losses (``add_loss``) whose form no rule over rows gives: on every backend
they train as on one device, batch after batch (``engines/global_losses``: a layer that
adds a loss runs on the global batch on TensorFlow and torch; JAX computes every loss on
the global batch).

- ``SumOrMean``: a sum over rows when the batch's mean is positive, a mean otherwise. The
  data makes a *later* batch take the branch one way on the whole batch and the other way
  on a replica's part (on today's main before this module: weighed by the rule probed on
  the first batches, silently, 1e-2 from one device);
- ``Spread``: a batch statistic (the variance over rows of the outputs), 0 on one row;
- a subclassed model that calls ``add_loss`` in its own ``call``.

78 rows in batches of 8 on 4 devices: 9 full batches (2 rows a replica) and one of 6
(2 + 2 + 1 + 1 on torch; TensorFlow's split of a ``tf.data`` batch 2 + 2 + 2 + 0).
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff

ROWS, BATCH = 78, 8


class SumOrMean(keras.layers.Layer):
    """Adds the sum over rows of h² when the mean of the model's inputs x is positive,
    else the mean over rows."""

    def call(self, inputs):
        x, h = inputs
        squares = keras.ops.square(h)
        self.add_loss(0.01 * keras.ops.where(keras.ops.mean(x) > 0, keras.ops.sum(squares),
                                             keras.ops.mean(squares)))
        return h


class Spread(keras.layers.Layer):
    """Adds the variance over the batch's rows of h (0 on one row)."""

    def call(self, inputs):
        _, h = inputs
        self.add_loss(0.5 * keras.ops.mean(keras.ops.var(h, axis=0)))
        return h


class OwnLossModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        h = self.hidden(x)
        self.add_loss(0.1 * keras.ops.square(keras.ops.mean(h)))  # a batch mean, squared
        return self.out(h)


def _functional(layer):
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(layer()([inputs, h])))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _subclassed():
    keras.utils.set_random_seed(8)
    model = OwnLossModel()
    model(np.zeros((2, 3), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(3)
    x = np.abs(rng.normal(size=(ROWS, 3))).astype("float32")
    x[40:42] *= -1.0  # batch 5: a positive mean, but its first replica's two rows negative
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    return x, y


def _fit(model, x, y, parallel):
    fitting = kmgpu.parallelize(model) if parallel else model
    history = fitting.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                          validation_data=(x[:20], y[:20]))
    return history.history


@pytest.mark.parametrize("build", [lambda: _functional(SumOrMean),
                                   lambda: _functional(Spread), _subclassed],
                         ids=["value-dependent", "batch-statistic", "subclassed-model"])
def test_own_loss_of_any_form_trains_as_one_device(build):
    x, y = _data()
    reference, model = build(), build()
    one = _fit(reference, x, y, parallel=False)
    many = _fit(model, x, y, parallel=True)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(many[key], one[key], rtol=1e-5)


def test_evaluate_counts_the_global_batch_loss():
    x, y = _data()
    reference, model = _functional(Spread), _functional(Spread)
    model.set_weights(reference.get_weights())
    one = reference.evaluate(x, y, batch_size=BATCH, verbose=0)
    many = kmgpu.parallelize(model).evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(many, one, rtol=1e-5)

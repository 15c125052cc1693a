"""A model's own losses (``add_loss``, regularizers) on several replicas equal one
device's whatever their form: a sum over rows, a mean over rows, the square of the
batch's mean. On TensorFlow and torch a layer that adds a loss runs on the global batch
(``kmgpu.engines.global_losses``) and each replica weighs the global value by its share
of the rows; JAX computes the loss on the global batch. 30 rows, batch 7 on 4 devices:
every batch splits unevenly."""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, keras_reference, rel_diff

ROWS, BATCH = 30, 7


class SumOverRows(keras.layers.Layer):
    """Adds a sum over rows (what kmgpu once weighed as a mean)."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
        return x


class MeanOverRows(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.abs(x)))
        return x


class SquaredBatchMean(keras.layers.Layer):
    """Neither a mean nor a sum over rows: the square of the batch's mean."""

    def call(self, x):
        self.add_loss(keras.ops.square(keras.ops.mean(x)))
        return x


def _model(*layers, compiled_loss=True):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", kernel_regularizer="l2")(inputs)
    h = keras.layers.Dense(2)(h)
    for layer in layers:  # every weight reaches the added losses (add_loss alone)
        h = layer()(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse" if compiled_loss else None)
    return model


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    return x, rng.normal(size=(ROWS, 2)).astype("float32")


def _fit(model, parallel=None, **kwargs):
    """``model.fit``, or ``parallel.fit`` (a ParallelModel of ``model``) when given."""
    x, y = _data()
    args = dict(x=x, y=y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    args.update(kwargs)
    if parallel is None:
        return model.fit(**args)
    with few_steps():
        return parallel.fit(**args)


@pytest.mark.parametrize("compiled_loss", [True, False], ids=["with-compiled-loss",
                                                              "add-loss-only"])
def test_sum_mean_and_batch_statistic_equal_one_device(compiled_loss):
    layers = (SumOverRows, MeanOverRows, SquaredBatchMean)
    reference = keras_reference(_model(*layers, compiled_loss=compiled_loss))
    model = _model(*layers, compiled_loss=compiled_loss)
    no_y = {} if compiled_loss else {"y": None}
    one = _fit(reference, **no_y)
    parallel = kmgpu.parallelize(model)
    many = _fit(model, parallel, **no_y)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
    if compiled_loss:  # the test step weighs them likewise
        x, y = _data()
        # 1e-4, not 1e-5: on JAX one suite run of three read 3.8e-5 here (weights and
        # History equal to 1e-5 in the same run; 0 in 6 runs of the file alone); a
        # mis-weighed loss is off by 1e-1 (test_add_loss_rows' cases before the fix)
        np.testing.assert_allclose(
            parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
            reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-4)

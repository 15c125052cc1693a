"""A stateful RNN model's own losses (``add_loss``) equal one device's whatever their
form, each replica keeping its state rows (on TensorFlow and torch the layer that adds
the loss runs on the global batch, ``engines/global_losses``; JAX computes every loss on
the global batch), and its per-output sample weights are checked batch by batch
(``engines/batch_checks``, TensorFlow and torch; JAX needs no such check).

Stateful LSTM, fixed batch of 8, 4 devices (2 rows each; the batch check: ``FEW``); one
device is kmgpu with ``gpus=1`` (plain Keras's torch fit crashes on stateful LSTMs, its JAX
fit drops the states).
"""

import warnings

import keras
import numpy as np
import pytest

import kmgpu
from kmgpu.engines import replication
from tests.helpers import listed_batches, one_device, rel_diff

B, STEPS, FEATURES, BATCHES = 8, 3, 2, 4
REFUSES = keras.backend.backend() != "jax"
#: the batch check is the same on any device count: 2 on TensorFlow (half the tracing of
#: 4), 4 on torch (its pool of 4 workers serves the whole file)
FEW = 2 if keras.backend.backend() == "tensorflow" else 4


class SumOverRows(keras.layers.Layer):
    """Adds a sum over rows: each replica's value counts whole."""

    def call(self, x):
        self.add_loss(0.05 * keras.ops.sum(keras.ops.square(x)))
        return x


class SquaredBatchMean(keras.layers.Layer):
    """Adds the square of the batch's mean: neither a mean nor a sum over rows."""

    def call(self, x):
        self.add_loss(keras.ops.square(keras.ops.mean(x)))
        return x


def _model(*own, outputs=1):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(batch_shape=(B, STEPS, FEATURES))
    h = keras.layers.LSTM(5, stateful=True)(inputs)
    h = keras.layers.Dense(3, activation="tanh")(h)
    for layer in own:
        h = layer()(h)
    if outputs == 1:
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h),
                                 "b": keras.layers.Dense(1, name="b")(h)})
    loss = lambda: keras.losses.MeanSquaredError(  # noqa: E731
        reduction="mean_with_sample_weight")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": loss(), "b": loss()})
    return model


def _xy():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(B * BATCHES, STEPS, FEATURES)).astype("float32")
    return x, np.tanh(x.sum(axis=(1, 2)))[:, None].astype("float32")


def _fit(model, gpus, x, y, epochs=2, **kwargs):
    if gpus == 1:
        with one_device():
            parallel = kmgpu.parallelize(model, gpus=1)
    else:
        parallel = kmgpu.parallelize(model, gpus=gpus)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"kmgpu: only \d+ step")
        return parallel.fit(x, y, batch_size=B, epochs=epochs, shuffle=False,
                            verbose=0, **kwargs)


@pytest.fixture(scope="module")
def sum_fits():
    """The model with both own losses fitted on 1 and on 4 devices (2 epochs, 4 batches
    each)."""
    x, y = _xy()
    one, four = _model(SumOverRows, SquaredBatchMean), _model(SumOverRows, SquaredBatchMean)
    start = four.get_weights()
    h1, h4 = _fit(one, 1, x, y), _fit(four, 4, x, y)
    return one, four, h1, h4, start


def test_own_losses_equal_one_device(sum_fits):
    """Each replica's rows give 0.05 sum(h²) over its 2 rows, one device's is over 8; the
    square of the batch's mean is neither (refused on TensorFlow and torch before
    ``global_losses``)."""
    one, four, h1, h4, start = sum_fits
    assert rel_diff(start, one.get_weights()) > 1e-2  # it trained
    assert rel_diff(one.get_weights(), four.get_weights()) < 1e-5
    np.testing.assert_allclose(h4.history["loss"], h1.history["loss"], rtol=1e-5)
    # the state rows came back too, replica by replica
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(replication.state_variables(four)[0].value),
        keras.ops.convert_to_numpy(replication.state_variables(one)[0].value), atol=1e-5)


def _later_batch_with_differing_output_weights_stops_there():
    """Per-output sample weights: one set in batches 0 and 1, different from batch 2 on
    (``FEW`` devices)."""
    x, y = _xy()
    rng = np.random.default_rng(2)
    wa = rng.uniform(0.1, 2.0, len(x)).astype("float32")
    wb = np.where(np.arange(len(x)) % 3 == 0, 0.0, 1.0).astype("float32")
    batches = []
    for k in range(BATCHES):
        rows = slice(k * B, (k + 1) * B)
        batches.append((x[rows], {"a": y[rows], "b": -y[rows]},
                        {"a": wa[rows], "b": (wa if k < 2 else wb)[rows]}))
    reference, model = _model(outputs=2), _model(outputs=2)
    with pytest.raises(NotImplementedError, match=r"batch 2 .*per-output sample weights"):
        _fit(model, FEW, listed_batches(batches), None, epochs=1)
    _fit(reference, 1, listed_batches(batches[:2]), None, epochs=1)
    # Keras's TensorFlow trainer counts the step whose data failed (plain Keras too)
    extra = (0, 1) if keras.backend.backend() == "tensorflow" else (0,)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) - 2 in extra
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


# JAX computes every loss on the global batch and runs no such check
if REFUSES:
    test_later_batch_with_differing_output_weights_stops_there = \
        _later_batch_with_differing_output_weights_stops_there

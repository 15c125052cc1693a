"""A model trained by its added losses only, with weights that reach no loss (here the
output layer: no compiled loss reads the output). Plain Keras trains it and leaves those
weights as they are; torch's DistributedDataParallel fails such a model at the second
step ("Expected to have finished reduction"), since it looks for unused weights from the
forward pass's outputs, so kmgpu trains such models with its split step on torch."""

import warnings

import keras
import numpy as np

import kmgpu
from tests.helpers import keras_reference, rel_diff


class SquaredActivations(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)))
        return x


def _model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = SquaredActivations()(keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))  # the output: no loss
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return model


def test_weights_no_loss_reaches_stay_and_the_rest_trains_as_on_one_device():
    x = np.random.default_rng(0).normal(size=(30, 4)).astype("float32")
    kw = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)  # a last batch of 6
    want, model = keras_reference(_model()), _model()
    start = [w.copy() for w in model.get_weights()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: "Gradients do not exist for variables"
        want_history = want.fit(x, None, **kw).history["loss"]
        history = kmgpu.parallelize(model, gpus=2).fit(x, None, **kw).history["loss"]
    assert rel_diff(want.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert not np.allclose(model.get_weights()[0], start[0])  # the added loss trained
    for got, first in zip(model.get_weights()[2:], start[2:]):  # the output layer did not
        np.testing.assert_array_equal(got, first)

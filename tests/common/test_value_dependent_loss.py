"""A model's own losses (``add_loss``) whose form no rule over rows gives: on every backend
they train as on one device, batch after batch (``engines/global_losses``: a layer that
adds a loss runs on the global batch on TensorFlow and torch; JAX computes every loss on
the global batch).

- ``SumOrMean``: a sum over rows when the batch's inputs have a positive mean, a mean
  otherwise. The data makes a *later* batch take the branch one way on the whole batch
  and the other way on a replica's part (before ``global_losses``, kmgpu probed a loss's
  form on a call's first batches and weighed this one by that rule, silently: 5.9e-3
  from one device on torch, 1.1e-2 on TensorFlow);
- ``Spread``: a batch statistic (the variance over rows of the outputs), 0 on one row;
- a script's own activity regularizer on a Keras layer (a variance over rows);
- ``Centered``: a moving mean updated in ``call`` beside its loss;
- a subclassed model that calls ``add_loss`` in its own ``call``.

78 rows in batches of 8 on 4 devices: 9 full batches (2 rows a replica) and one of 6
(2 + 2 + 1 + 1 on torch; TensorFlow's split of a ``tf.data`` batch 2 + 2 + 2 + 0).
"""

import functools
import re

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, keras_reference, rel_diff

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


class BatchVariance(keras.regularizers.Regularizer):
    """An activity regularizer: the variance over rows times the rows (Keras divides an
    activity regularizer by the batch size: the variance is what counts)."""

    def __call__(self, x):
        rows = keras.ops.cast(keras.ops.shape(x)[0], x.dtype)
        return 0.5 * keras.ops.sum(keras.ops.var(x, axis=0)) * rows

    def get_config(self):
        return {}


class Centered(keras.layers.Layer):
    """Keeps a moving mean of its inputs (updated in ``call``, training only) and adds the
    mean squared distance from it: the moving mean must move once per step, by the global
    batch's mean, as on one device."""

    def build(self, input_shape):
        self.moving = self.add_weight(shape=(input_shape[1][-1],), initializer="zeros",
                                      trainable=False, name="moving")

    def call(self, inputs, training=False):
        _, h = inputs
        if training:
            self.moving.assign(0.9 * self.moving + 0.1 * keras.ops.mean(h, axis=0))
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h - self.moving)))
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


def _combined():
    """Every form at once: the activity regularizer on the first Dense, then SumOrMean,
    Spread and Centered (defined below) on its outputs."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh", activity_regularizer=BatchVariance())(inputs)
    for layer in (SumOrMean, Spread, Centered):
        h = layer()([inputs, h])
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
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
    return history.history, fitting


@functools.lru_cache(maxsize=None)
def _fits(build):
    """``build``'s model fitted on one device and on 4, once per module: (the one-device
    model, its History, the user's model of the ParallelModel, its History, the
    ParallelModel). The evaluate test and torch's split step start from these."""
    x, y = _data()
    reference, model = keras_reference(build()), build()
    one, _ = _fit(reference, x, y, parallel=False)
    many, parallel = _fit(model, x, y, parallel=True)
    return reference, one, model, many, parallel


@pytest.mark.parametrize("build", [_combined, _subclassed], ids=["layers", "subclassed-model"])
def test_own_loss_of_any_form_trains_as_one_device(build):
    """Weights, History and the moving mean ``Centered`` updates in ``call`` (its first
    call in a step runs on the replica's rows before kmgpu knows it adds a loss; that
    call's update is undone, so the mean moves once per step, as on one device)."""
    reference, one, model, many, _ = _fits(build)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(many[key], one[key], rtol=1e-5)
    moving = [[np.asarray(keras.ops.convert_to_numpy(v.value)) for v in m.non_trainable_weights]
              for m in (reference, model)]
    assert len(moving[0]) == (1 if build is _combined else 0)
    for a, b in zip(*moving):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_evaluate_counts_the_global_batch_loss():
    """From the weights the layers' fit left (equal on both sides): the whole 78 rows,
    the last batch of 6 split 2 + 2 + 1 + 1 (or 2 + 2 + 2 + 0)."""
    x, y = _data()
    reference, _, _, _, parallel = _fits(_combined)
    one = reference.evaluate(x, y, batch_size=BATCH, verbose=0)
    many = parallel.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(many, one, rtol=1e-5)
    plan = str(parallel.describe(print_fn=lambda text: None))
    assert re.search(r"own losses +on the global batch \(one jit" if keras.backend.backend()
                     == "jax" else r"own losses .*\(sum_or_mean_\d+, spread_\d+, centered_\d+\) "
                     r"that adds one runs on the global batch on each of the 4 replicas", plan), plan


# -- a model's own train_step (keras.io's guide), TensorFlow and torch --------------------
def _own_step_model(loss="mse"):
    backend = keras.backend.backend()

    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data
            if backend == "torch":
                import torch

                self.zero_grad()
                y_pred = self(x, training=True)
                value = self.compute_loss(x=x, y=y, y_pred=y_pred)
                value.backward()
                grads = [v.value.grad for v in self.trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(grads, self.trainable_weights)
            else:
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    value = self.compute_loss(x=x, y=y, y_pred=y_pred)
                grads = tape.gradient(value, self.trainable_weights)
                self.optimizer.apply(grads, self.trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(value)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(inputs)
    model = OwnStep(inputs, keras.layers.Dense(1)(Spread()([inputs, h])))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    return model


def _own_step_equals_one_device():
    """Batches of 7 on 4 devices (2 + 2 + 2 + 1 rows): the replicas' gradients are
    weighed by their shares, and the gathered rows' gradient counts once."""
    x, y = _data()
    reference, model = keras_reference(_own_step_model()), _own_step_model()
    reference.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    kmgpu.parallelize(model).fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


def _stateful_layer_adding_a_loss_is_refused():
    """A layer that adds a loss and holds a stateful LSTM cannot run on the global batch
    (each replica keeps its own state rows): refused at the first step, the model
    untouched."""

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lstm = keras.layers.LSTM(3, stateful=True)

        def build(self, input_shape):
            self.lstm.build(input_shape)

        def call(self, x):
            h = self.lstm(x)
            self.add_loss(keras.ops.mean(keras.ops.var(h, axis=0)))
            return h

    keras.utils.set_random_seed(4)
    inputs = keras.Input(batch_shape=(8, 2, 3))
    model = keras.Model(inputs, keras.layers.Dense(1)(Block()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 2, 3)).astype("float32"), rng.normal(size=(16, 1))
    before = model.get_weights()
    with few_steps(), pytest.raises(NotImplementedError, match="holds the stateful RNN"):
        kmgpu.parallelize(model).fit(x, y, batch_size=8, epochs=1, shuffle=False,
                                     verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def _own_train_step_with_a_summed_loss_is_refused():
    """torch weighs the gradients of a model's own train_step by each rank's share after
    the backward pass; a summed compiled loss has shares of 1, so a loss every rank adds
    whole would count 4 times in its layer's weights: refused at the first step."""
    x, y = _data()
    model = _own_step_model(loss=keras.losses.MeanSquaredError(reduction="sum"))
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match="reduced by 'sum'"):
        kmgpu.parallelize(model).fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


if keras.backend.backend() != "jax":  # JAX: the whole step is one jit over the global batch
    test_own_train_step_equals_one_device = _own_step_equals_one_device
    test_stateful_layer_adding_a_loss_is_refused = _stateful_layer_adding_a_loss_is_refused


def _split_step_equals_one_device():
    """torch's split step (the default on GPUs; on a CPU with jit_compile=True) gathers
    alike inside its forward pass."""
    x, y = _data()
    reference, one, _, _, _ = _fits(_combined)  # the one-device side of the layers' test
    model = _combined()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    many, _ = _fit(model, x, y, parallel=True)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(many["val_loss"], one["val_loss"], rtol=1e-5)


if keras.backend.backend() == "torch":  # TensorFlow weighs the loss itself, not the gradients
    test_own_train_step_with_a_summed_loss_is_refused = \
        _own_train_step_with_a_summed_loss_is_refused
    test_split_step_equals_one_device = _split_step_equals_one_device


class AddsWhenPositive(keras.layers.Layer):
    """Adds a loss only when the batch's mean is positive, decided in Python."""

    def call(self, inputs):
        x, h = inputs
        if float(keras.ops.convert_to_numpy(keras.ops.mean(x))) > 0:
            self.add_loss(0.01 * keras.ops.sum(keras.ops.square(h)))
        return h


def _python_branch_on_the_data_is_refused():
    """Eager torch: the first batches add no loss; batch 3 adds one on the replica whose
    rows have a positive mean (the others add none, they wait on it): the call is
    refused there, not hung, the model left as before the call, and the next call runs."""
    rng = np.random.default_rng(5)
    x = -np.abs(rng.normal(size=(40, 3))).astype("float32")
    x[24:26] *= -3.0  # batch 3: its first replica's rows positive, the batch's mean not
    y = rng.normal(size=(40, 1)).astype("float32")
    model = _functional(AddsWhenPositive)
    before = model.get_weights()
    with few_steps(), pytest.raises(NotImplementedError, match="decides in Python"):
        kmgpu.parallelize(model).fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    x, y = _data()
    reference, model = _functional(Spread), _functional(Spread)
    _fit(reference, x, y, parallel=False)
    _fit(model, x, y, parallel=True)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


if keras.backend.backend() == "torch":  # eager: TensorFlow's steps are traced graphs
    test_python_branch_on_the_data_is_refused = _python_branch_on_the_data_is_refused

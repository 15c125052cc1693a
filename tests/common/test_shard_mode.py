"""``shard=`` is a mode, not a feature: what users pass to ``fit`` equals one device under
every ``shard`` value the backend takes. One fit per case and value, shared by the
assertions (weights, each History entry, evaluate, predict):

- a classifier fitted with class weights and evaluated with sample weights, count-weighed
  metrics (accuracy, AUC, precision), validation data and Keras callbacks that change the
  learning rate;
- a model of the script's own class with its own ``train_step`` (the Keras guide's).

Masked losses and metrics: test_masked_losses.py; state between calls:
test_between_calls.py; both under every value too.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff, shard_values

TOL = 1e-5
ROWS, BATCH = 83, 8  # 11 steps, the last of 3 rows: it does not divide over 4 devices


def _classifier():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"),
                           keras.metrics.Precision(name="precision")])
    return model


def _classifier_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0.5).astype("float32")
    w = rng.uniform(0.2, 2.0, ROWS).astype("float32")
    return x, y, w


def _fit_classifier(target, model):
    x, y, w = _classifier_data()
    history = target.fit(
        x, y, class_weight={0: 1.0, 1: 2.5}, batch_size=BATCH, epochs=3,
        shuffle=False, verbose=0, validation_data=(x[:20], y[:20]),
        callbacks=[keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5),
                   keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0,
                                                     factor=0.9, min_delta=10.0)])
    scores = target.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0,
                             return_dict=True)
    return (model.get_weights(), history.history, scores,
            target.predict(x, batch_size=BATCH, verbose=0))


class OwnStep(keras.Model):
    """The Keras guide's custom ``train_step``: its own loss and metric updates."""

    def train_step(self, *args):
        if keras.backend.backend() == "jax":  # the guide's JAX step is stateless
            return self._stateless_step(*args)
        x, y = args[0]
        if keras.backend.backend() == "torch":
            import torch

            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply(grads, self.trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


    def _stateless_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_vars, metric_vars = state
        x, y = data

        def loss_fn(trainable, non_trainable):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                        training=True)
            return self.compute_loss(x, y, y_pred), (y_pred, non_trainable)

        (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(
            loss_fn, has_aux=True)(trainable, non_trainable)
        trainable, optimizer_vars = self.optimizer.stateless_apply(
            optimizer_vars, grads, trainable)
        logs, updated = {}, []
        for metric in self.metrics:
            mine = metric_vars[len(updated):len(updated) + len(metric.variables)]
            if metric.name == "loss":
                mine = metric.stateless_update_state(mine, loss)
            else:
                mine = metric.stateless_update_state(mine, y, y_pred)
            logs[metric.name] = metric.stateless_result(mine)
            updated += mine
        return logs, (trainable, non_trainable, optimizer_vars, updated)


def _own_step():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    model = OwnStep(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _fit_own_step(target, model):
    x, _, _ = _classifier_data()
    y = x[:, :3].sum(axis=1, keepdims=True)
    history = target.fit(x[:80], y[:80], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history, None, target.predict(x, verbose=0)


CASES = {"classifier": (_classifier, _fit_classifier), "own_step": (_own_step, _fit_own_step)}


@pytest.fixture(scope="module")
def one_device():
    return {case: _one(case) for case in CASES}


def _one(case):
    make, fit = CASES[case]
    model = make()
    return fit(model, model)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shard", shard_values(), ids=str)
def test_fit_equals_one_device_under_every_shard(one_device, case, shard):
    make, fit = CASES[case]
    model = make()
    weights, history, scores, predictions = fit(kmgpu.parallelize(model, shard=shard), model)
    ref_weights, ref_history, ref_scores, ref_predictions = one_device[case]
    assert rel_diff(ref_weights, weights) <= TOL
    assert history.keys() == ref_history.keys()
    for key, values in ref_history.items():
        np.testing.assert_allclose(history[key], values, rtol=TOL, atol=1e-6, err_msg=key)
    if scores is not None:
        for key, value in ref_scores.items():
            np.testing.assert_allclose(scores[key], value, rtol=TOL, atol=1e-6, err_msg=key)
    assert predictions.shape == ref_predictions.shape
    np.testing.assert_allclose(predictions, ref_predictions, rtol=TOL, atol=1e-6)

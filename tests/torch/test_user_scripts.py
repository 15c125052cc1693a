"""Ordinary Keras 3 training code under kmgpu on torch equals one device:
tf.data datasets and Python generators, custom train steps, one rule for datasets.
"""

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


def _close(got, want, what):
    assert got.keys() == want.keys(), what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=TOL, err_msg=f"{what}: {key}")


# -- tf.data datasets and Python generators --------------------------------------------
def _tf_data(x, y=None, batch=12, shuffle=True):
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
    if shuffle:  # reshuffled every epoch: every pass must be read anew
        ds = ds.shuffle(len(x), seed=3)
    return ds.batch(batch)


@pytest.mark.parametrize("samples", [48, 45])  # 45: the last batch of 9 splits 3/2/2/2
def test_tf_data_fit_evaluate_predict_equal_one_device(samples):
    import keras

    x, y = data("mlp", samples)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
    keras.utils.set_random_seed(5)
    want = ref.fit(_tf_data(x, y), validation_data=_tf_data(x, y, shuffle=False),
                   epochs=3, verbose=0).history
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    keras.utils.set_random_seed(5)
    with few_steps():
        got = parallel.fit(_tf_data(x, y), validation_data=_tf_data(x, y, shuffle=False),
                           epochs=3, verbose=0).history
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    _close(got, want, "history")
    pred = parallel.predict(_tf_data(x, batch=10, shuffle=False), verbose=0)
    assert pred.shape == (samples, 1)  # every row once, in order
    np.testing.assert_allclose(pred, ref.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    _close(parallel.evaluate(_tf_data(x, y, shuffle=False), verbose=0, return_dict=True),
           ref.evaluate(_tf_data(x, y, shuffle=False), verbose=0, return_dict=True), "eval")


def test_a_generator_that_runs_out_says_what_to_do():
    x, y = data("mlp", 48)

    def batches():  # 4 batches, while fit asks for 3 x 4
        for i in range(0, 48, 12):
            yield x[i:i + 12], y[i:i + 12]

    parallel = kmgpu.parallelize(mlp(), gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="ran out.*while True.*repeat"), few_steps():
        parallel.fit(batches(), steps_per_epoch=4, epochs=3, verbose=0)
    parallel.fit(x, y, batch_size=12, epochs=1, verbose=0)  # the next call works


# -- a custom train_step (the Keras 3 guide's torch pattern) ---------------------------
def _guide_class():
    import keras
    import torch

    @keras.saving.register_keras_serializable(package="kmgpu_torch_tests")
    class TorchGuideModel(keras.Model):
        """"Customizing what happens in fit() with PyTorch", as printed."""

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return TorchGuideModel


def _guide_model(cls):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


# 48: even; 45: the last batch of 9 splits 3/2/2/2; 49: the last batch of 1 leaves three
# replicas a stand-in row
@pytest.mark.parametrize("samples", [48, 45, 49])
def test_custom_train_step_history_and_weights_equal_one_device(samples):
    cls = _guide_class()
    x, y = data("mlp", samples)
    y = 3 * y  # a loss far from 1: a shard's loss differs from the batch's
    ref = _guide_model(cls)
    want = ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    model = _guide_model(cls)
    parallel = kmgpu.parallelize(model, gpus=4)
    with few_steps():
        got = parallel.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
    _close(got, want, "history")
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL


# -- one rule for what a dataset is ------------------------------------------------------
def test_one_rule_says_what_a_dataset_is():
    import keras
    import tensorflow as tf
    import torch

    from kmgpu import api, checks
    from kmgpu.engines.datasets import is_dataset
    from kmgpu.engines.torch.data import inputs as torch_data

    assert torch_data.is_dataset is is_dataset
    assert not any(hasattr(m, n) for m in (api, checks) for n in ("is_dataset", "_is_dataset"))

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return np.zeros((2, 5)), np.zeros((2, 1))

    x = np.zeros((4, 5), "float32")
    datasets = [tf.data.Dataset.from_tensor_slices(x).batch(2), Batches(), iter([x]),
                (row for row in [x]),
                torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 5)))]
    arrays = [x, torch.zeros(4, 5), tf.zeros((4, 5)), [x, x], (x,), {"a": x}, None, "x.npy",
              b"x", 3, 2.5, memoryview(b"ab")]
    assert all(is_dataset(d) for d in datasets)
    assert not any(is_dataset(a) for a in arrays)

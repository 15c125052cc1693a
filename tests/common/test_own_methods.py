"""Three patterns keras-hub's task models have, each in a small plain-Keras model, each
equal to one device on 2 devices:

- a model class with its own ``fit`` / ``evaluate`` / ``predict`` that works on the data,
  then calls ``super()`` (keras-hub's tasks preprocess into ``tf.data`` first): it runs
  once per call, on the user's model, and kmgpu takes over at ``super()``;
- variables added after build (``enable_lora`` on a layer its parent builds) and trainable
  flags set after build, which no config carries;
- a model class whose ``__setattr__`` keeps Keras's torch parameters out of
  ``parameters()`` (keras-hub's on torch), which DistributedDataParallel then cannot see.
"""

import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, rel_diff

TOL = 1e-5
#: calls of the model's own methods, in order (its class records them)
CALLS = []


def _split_model():
    """A functional model of a class with its own methods: fit and evaluate take rows of
    6 numbers and learn the last 2 from the first 4; predict returns 100 x the output.
    On torch its ``__setattr__`` is keras-hub's (attributes set before ``__init__`` ends
    bypass torch's registration, Keras's torch parameters among them)."""
    import keras

    class Split(keras.Model):
        def __init__(self, **kwargs):
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
            super().__init__(inputs, keras.layers.Dense(2, name="out")(hidden), **kwargs)
            self.ready = True

        def __setattr__(self, name, value):
            if keras.config.backend() == "torch" and "ready" not in self.__dict__:
                return object.__setattr__(self, name, value)
            return super().__setattr__(name, value)

        def get_config(self):
            return {"name": self.name, "trainable": self.trainable}

        def fit(self, x=None, batch_size=None, **kwargs):
            CALLS.append("fit")
            return super().fit(x[:, :4], x[:, 4:], batch_size=batch_size, **kwargs)

        def evaluate(self, x=None, batch_size=None, **kwargs):
            CALLS.append("evaluate")
            return super().evaluate(x[:, :4], x[:, 4:], batch_size=batch_size, **kwargs)

        def predict(self, x=None, batch_size=None, **kwargs):
            CALLS.append("predict")
            return 100 * super().predict(x[:, :4], batch_size=batch_size, **kwargs)

    keras.utils.set_random_seed(3)
    model = Split()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def test_a_models_own_methods_run_once_on_it_and_equal_one_device():
    import keras

    rows = np.random.default_rng(0).normal(size=(40, 6)).astype("float32")
    ref, model = _split_model(), _split_model()
    model.set_weights(ref.get_weights())
    if keras.config.backend() == "torch":  # the pattern is there: torch sees no parameter
        assert not list(model.parameters()) and model.trainable_weights
    ref.fit(rows, batch_size=8, epochs=2, shuffle=False, verbose=0)
    CALLS.clear()
    parallel = kmgpu.parallelize(model, gpus=2)
    with few_steps():
        history = parallel.fit(rows, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    for key, values in ref.history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    got = parallel.predict(rows[:13], batch_size=4, verbose=0)
    np.testing.assert_allclose(got, ref.predict(rows[:13], batch_size=4, verbose=0),
                               rtol=1e-5, atol=1e-4)
    assert got.shape == (13, 2) and np.abs(got).max() > 10  # the own predict's 100 x
    scores = parallel.evaluate(rows, batch_size=8, verbose=0, return_dict=True)
    want = ref.evaluate(rows, batch_size=8, verbose=0, return_dict=True)
    assert scores == pytest.approx(want, rel=1e-5)
    assert CALLS == ["fit", "predict", "predict", "evaluate", "evaluate"]  # kmgpu's, ref's
    assert type(model).__name__ == "Split" and "Hook" not in str(type(model).__mro__)


def test_a_models_own_method_that_never_calls_keras_is_said():
    import keras

    class Own(keras.Sequential):
        def predict(self, x, **kwargs):
            return np.zeros((len(x), 1))

    model = Own([keras.Input((3,)), keras.layers.Dense(1)])
    parallel = kmgpu.parallelize(model, gpus=2)
    with pytest.warns(UserWarning, match=r"Own.predict returned without calling "
                                         r"keras.Model.predict: it ran as your own code"):
        assert parallel.predict(np.ones((4, 3))).shape == (4, 1)


def _block_model():
    """Dense(6) -> a block whose two inner Dense layers it builds itself -> Dense(1)."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(6, activation="tanh")
            self.second = keras.layers.Dense(6)

        def build(self, shape):
            self.first.build(shape)
            self.second.build(shape[:-1] + (6,))

        def call(self, x):
            return self.second(self.first(x))

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6), Block(name="block"),
                              keras.layers.Dense(1)])
    block = model.get_layer("block")
    block.first.enable_lora(2)  # two variables more, its kernel frozen
    block.second.trainable = False  # in no config: Block's says nothing of its layers
    model.layers[0].bias.trainable = False
    model.compile(optimizer="adam", loss="mse")
    return model


def test_lora_and_trainable_flags_set_after_build_equal_one_device():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(32, 5)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    ref, model = _block_model(), _block_model()
    model.set_weights(ref.get_weights())
    frozen = [w.copy() for w, v in zip(model.get_weights(), model.weights) if not v.trainable]
    # Dense(6)'s kernel (its bias frozen); block.first's bias and LoRA's two (its kernel
    # frozen); block.second none; Dense(1)'s two
    assert len(model.trainable_weights) == 6
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    parallel = kmgpu.parallelize(model, gpus=2)
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    still = [w for w, v in zip(model.get_weights(), model.weights) if not v.trainable]
    assert all(np.array_equal(a, b) for a, b in zip(frozen, still))
    lora_b = model.get_layer("block").first.lora_kernel_b
    assert np.abs(lora_b.numpy()).max() > 1e-3  # starts at zero: it trained


def test_a_variable_added_after_build_otherwise_is_refused_clearly():
    import keras

    class Grows(keras.layers.Dense):
        def grow(self):  # a variable added after build, as enable_lora adds its own
            self._tracker.unlock()
            self.extra = self.add_weight(shape=(2,), name="extra")
            self._tracker.lock()

    model = keras.Sequential([keras.Input((3,)), Grows(2, name="dense")])
    model.layers[0].grow()
    model.compile(optimizer="sgd", loss="mse")
    parallel = kmgpu.parallelize(model, gpus=2)
    with pytest.raises(ValueError, match=r"the first that differ: sequential\w*/dense/extra \(2,\) in "
                                         r"sequential.*added otherwise after build"):
        parallel.predict(np.ones((4, 3)), verbose=0)

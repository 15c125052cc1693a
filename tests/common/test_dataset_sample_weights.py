"""Per-output sample weights given inside a dataset (x, {out: y}, {out: w}) under the
"mean_with_sample_weight" reduction: TensorFlow and torch weigh each replica's share of
the loss by one set of weight sums, so, as for arrays (``test_sample_weights``), weights
that differ per output are refused before any work, read from the dataset's first batch
(later batches are not checked); JAX equals one device. The same weights for every
output equal one device everywhere."""

import functools

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff

ROWS, BATCH = 30, 7


def _model():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h),
                                 "b": keras.layers.Dense(1, name="b")(h)})
    loss = lambda: keras.losses.MeanSquaredError(  # noqa: E731
        reduction="mean_with_sample_weight")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": loss(), "b": loss()})
    return model


def _batches(same):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = {k: rng.normal(size=(ROWS, 1)).astype("float32") for k in "ab"}
    wa = rng.uniform(0.1, 2.0, ROWS).astype("float32")
    wb = wa if same else np.where(np.arange(ROWS) % 3 == 0, 0.0, 1.0).astype("float32")
    for s in range(0, ROWS, BATCH):
        rows = slice(s, s + BATCH)
        yield x[rows], {k: v[rows] for k, v in y.items()}, {"a": wa[rows], "b": wb[rows]}


def _data(kind, same):
    if kind == "generator":
        return _batches(same)
    import tensorflow as tf

    batches = list(_batches(same))
    return tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=tf.nest.map_structure(
            lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.float32), batches[0]))


@pytest.mark.parametrize("kind", ["generator", "tf.data"])
def test_differing_output_weights_in_a_dataset_refused_or_exact(kind):
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    parallel = kmgpu.parallelize(model)
    if keras.backend.backend() != "jax":
        with pytest.raises(NotImplementedError, match="per-output sample weights that differ"):
            parallel.fit(_data(kind, same=False), epochs=1, shuffle=False, verbose=0)
        assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        assert not model.optimizer.built
        return
    parallel.fit(_data(kind, same=False), epochs=1, shuffle=False, verbose=0)
    assert rel_diff(_one_device_differing(), model.get_weights()) < 1e-5


@functools.lru_cache(maxsize=None)
def _one_device_differing():
    """Plain Keras's weights after an epoch of the differing weights' batches, made once
    for the generator and the tf.data case: both serve the same batches, which plain
    Keras reads alike."""
    reference = _model()
    reference.fit(_batches(same=False), epochs=1, shuffle=False, verbose=0)
    return reference.get_weights()


def test_same_output_weights_in_a_dataset_equal_one_device():
    reference, model = _model(), _model()
    one = reference.fit(_batches(same=True), epochs=1, shuffle=False, verbose=0)
    many = kmgpu.parallelize(model).fit(_batches(same=True), epochs=1, shuffle=False,
                                        verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)

"""Per-output sample weights that differ, with the "mean_with_sample_weight" reduction:
TensorFlow and torch weigh each replica's share of the loss by one set of weight sums, so
they refuse such a call before any work (model untouched); JAX computes the loss on the
global batch and equals one device."""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, rel_diff

ROWS, BATCH = 30, 8


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(h),
                                 keras.layers.Dense(1, name="b")(h)])
    loss = lambda: keras.losses.MeanSquaredError(  # noqa: E731
        reduction="mean_with_sample_weight")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=[loss(), loss()])
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = [rng.normal(size=(ROWS, 1)).astype("float32") for _ in range(2)]
    w = [rng.uniform(0.1, 2.0, ROWS).astype("float32"), np.ones(ROWS, "float32")]
    w[1][::3] = 0.0
    return x, y, w


def test_differing_output_weights_refused_or_exact():
    x, y, w = _data()
    model = _model()
    before = [a.copy() for a in model.get_weights()]
    parallel = kmgpu.parallelize(model)
    if keras.backend.backend() != "jax":
        with few_steps(), pytest.raises(NotImplementedError,
                                        match="per-output sample weights that differ"):
            parallel.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, shuffle=False,
                         verbose=0)
        assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        assert not model.optimizer.built
        return
    reference = _model()
    reference.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with few_steps():
        parallel.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5

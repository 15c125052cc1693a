"""A model's own loss whose form depends on the data's values, not on the row count: a sum
over rows when the batch's mean is positive, a mean otherwise (README, "Not covered").
The probe runs on the replicas' own split of the batches it sees (``engines/loss_rows``):
when such a batch takes the branch one way on the whole batch and the other way on a
replica's part, no rule fits and TensorFlow and torch refuse the call before any work
(JAX computes the loss on the global batch: no test here). Pins the README's statement of
what is detected; this passes on the previous main too.
"""

import keras
import numpy as np
import pytest

import kmgpu

REFUSES = keras.backend.backend() != "jax"


class SumOrMean(keras.layers.Layer):
    def call(self, x):
        squares = keras.ops.square(x)
        self.add_loss(0.01 * keras.ops.where(keras.ops.mean(x) > 0, keras.ops.sum(squares),
                                             keras.ops.mean(squares)))
        return x


def _model():
    keras.utils.set_random_seed(8)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(SumOrMean()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _branch_taken_differently_on_a_replica_part_is_refused_before_any_work():
    rng = np.random.default_rng(3)
    x = np.abs(rng.normal(size=(80, 3))).astype("float32")
    x[:2] *= -4.0  # batch 0: a positive mean, but replica 0's two rows a negative one
    y = rng.normal(size=(80, 1)).astype("float32")
    model = _model()
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match=r"on a batch's 8 rows .* \[2, 2, 2, 2\]"):
        kmgpu.parallelize(model).fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


if REFUSES:  # JAX computes the loss on the global batch (tests/common/test_every_batch)
    test_branch_taken_differently_on_a_replica_part_is_refused_before_any_work = \
        _branch_taken_differently_on_a_replica_part_is_refused_before_any_work

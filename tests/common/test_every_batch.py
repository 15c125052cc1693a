"""Every batch of a dataset gets the checks its first batch gets (``engines/batch_checks``):
on TensorFlow and torch a later batch that the replicas cannot weigh as one device stops
the call at that batch with an error naming it, the user's model holding what plain
Keras holds after the batches before it; JAX computes every loss on the global batch
and equals one device. 78 rows in batches of 7 or 8, on 4 devices where a replica must
get one row, else on ``FEW``.

- per-output sample weights under "mean_with_sample_weight": one set in the first two
  batches (or none at all), different sets from batch 2 on (a generator, a PyDataset,
  ``tf.data``);
- a model's own loss (``add_loss``) that is a mean over rows but 0 on one row (as a
  variance or a pairwise term is), where a batch's split gives a replica one row (the
  last partial batch of arrays or of a generator): it equals
  one device on every backend (the layer runs on the global batch,
  ``engines/global_losses``; refused on TensorFlow and torch before it).
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.common.test_dataset_sample_weights import _model as _weights_model
from tests.helpers import keras_reference, listed_batches, one_device_input, rel_diff

ROWS = 78  # batches of 7: 11 of them and one row; of 8: 9 and 6 rows (10 steps: no warning)
REFUSES = keras.backend.backend() != "jax"
#: devices where 4 add nothing specific: 2 on TensorFlow (half the tracing of 4); torch and
#: JAX keep 4 (torch's pool of 4 workers serves the whole file)
FEW = 2 if keras.backend.backend() == "tensorflow" else 4




def _weighted_batches(first_unweighted=False, size=7):
    """Batches of (x, {a, b}[, {a, b} weights]): the same weights for both outputs in
    batches 0 and 1 (or none, ``first_unweighted``), different ones from batch 2 on."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = {k: rng.normal(size=(ROWS, 1)).astype("float32") for k in "ab"}
    wa = rng.uniform(0.1, 2.0, ROWS).astype("float32")
    wb = np.where(np.arange(ROWS) % 3 == 0, 0.0, 1.0).astype("float32")
    out = []
    for i, s in enumerate(range(0, ROWS, size)):
        rows = slice(s, s + size)
        batch = (x[rows], {k: v[rows] for k, v in y.items()})
        if i >= 2:
            out.append(batch + ({"a": wa[rows], "b": wb[rows]},))
        elif not first_unweighted:
            out.append(batch + ({"a": wa[rows], "b": wa[rows]},))
        else:
            out.append(batch)
    return out


def _data(kind, batches):
    if kind == "generator":
        return (b for b in batches)
    if kind == "pydataset":
        return listed_batches(batches)
    import tensorflow as tf

    return tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=tf.nest.map_structure(
            lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.float32), batches[0]))


def _refused_at(build, kind, batches, k, match):
    """kmgpu's fit of ``batches`` stops at batch ``k`` (TF, torch) with the model where
    plain Keras is after batches 0 .. k-1; on JAX it equals one device on all of them.
    ``FEW`` devices: the batch check is the same on any count."""
    reference, model = build(), build()
    parallel = kmgpu.parallelize(model, gpus=FEW)
    if not REFUSES:
        reference.fit(one_device_input(_data(kind, batches)), epochs=1, shuffle=False,
                      verbose=0)
        parallel.fit(_data(kind, batches), epochs=1, shuffle=False, verbose=0)
        assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
        return
    reference.fit(one_device_input(_data(kind, batches[:k])), epochs=1, shuffle=False,
                  verbose=0)
    with pytest.raises(NotImplementedError, match=match):
        parallel.fit(_data(kind, batches), epochs=1, shuffle=False, verbose=0)
    # Keras's TensorFlow trainer counts the step whose data failed (plain Keras too)
    extra = (0, 1) if keras.backend.backend() == "tensorflow" else (0,)
    assert int(model.optimizer.iterations.numpy()) - k in extra
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


#: JAX runs every kind alike (Keras's own adapters, the loss on the global batch): one
@pytest.mark.parametrize("kind", ["generator", "pydataset", "tf.data"] if REFUSES
                         else ["pydataset"])
def test_later_batch_with_differing_output_weights_stops_there(kind):
    _refused_at(_weights_model, kind, _weighted_batches(), 2,
                r"batch 2 .*per-output sample weights that differ")


def test_later_batch_bringing_differing_output_weights_stops_there():
    """The first batches carry no sample weights at all, the later ones per-output sets."""
    _refused_at(_weights_model, "pydataset", _weighted_batches(first_unweighted=True), 2,
                r"batch 2 .*per-output sample weights that differ")


class MeanFromTwoRows(keras.layers.Layer):
    """Adds the mean of x² over the rows, or 0 on a single row."""

    def call(self, x):
        n = keras.ops.shape(x)[0]
        self.add_loss(keras.ops.where(n > 1, keras.ops.mean(keras.ops.square(x)), 0.0))
        return x


def _loss_model():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    h = MeanFromTwoRows()(keras.layers.Dense(2)(h))
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _xy():
    rng = np.random.default_rng(1)
    return (rng.normal(size=(ROWS, 4)).astype("float32"),
            rng.normal(size=(ROWS, 2)).astype("float32"))


def test_own_loss_zero_on_one_row_equals_one_device():
    """A generator's last batch of 6 rows arrives mid-fit: 2 + 2 + 1 + 1 (arrays:
    tests/common/test_value_dependent_loss)."""
    x, y = _xy()
    reference, model = keras_reference(_loss_model()), _loss_model()
    batches = [(x[s:s + 8], y[s:s + 8]) for s in range(0, ROWS, 8)]
    one = reference.fit(_data("generator", batches), epochs=1, shuffle=False, verbose=0)
    many = kmgpu.parallelize(model).fit(_data("generator", batches), epochs=1, shuffle=False,
                                        verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)


class SumAndMean(keras.layers.Layer):
    """Adds a sum over rows and a mean over rows."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
        self.add_loss(0.1 * keras.ops.mean(keras.ops.abs(x)))
        return x


def _sum_mean_model():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, SumAndMean()(keras.layers.Dense(2)(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.parametrize("kind", ["generator", "tf.data"])
def test_new_row_count_mid_fit_trains_as_one_device(kind):
    """10 batches of 7 rows and one of 8: the last brings a row count the first batch did
    not show; a sum and a mean over rows added by one layer train as on one device,
    History included. ``FEW`` devices: 7 rows split unevenly over 2 as over 4."""
    x, y = _xy()
    sizes = [7] * 10 + [8]
    starts = np.cumsum([0] + sizes)
    batches = [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    reference, model = keras_reference(_sum_mean_model()), _sum_mean_model()
    one = reference.fit(_data(kind, batches), epochs=1, shuffle=False, verbose=0)
    many = kmgpu.parallelize(model, gpus=FEW).fit(_data(kind, batches), epochs=1,
                                                  shuffle=False, verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)

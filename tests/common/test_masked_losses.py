"""A loss over a masked sequence weighs as on one device: Keras divides a masked mean
loss by the valid timesteps of the whole batch, so each replica's part is its summed
loss over the batch's valid timesteps, not over its own. One model with two outputs,
each masked differently: Embedding(mask_zero=True) -> Dense -> TimeDistributed(Dense)
(the masks an RNN passes on work alike; no RNN here, to keep the test fast), and
Masking followed by a layer of the script's own that masks one more timestep
(compute_mask). Rows sorted by length, so the replicas' valid
timesteps differ widely; on 2 devices the last batch (1 row) leaves one replica with no
row and no valid timestep at all.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff, shard_values


TOL = 1e-5
ROWS, BATCH, T = 81, 8, 6


class SkipFirstStep(keras.layers.Layer):
    """The script's own mask: the incoming one without the first timestep."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs):
        return inputs

    def compute_mask(self, inputs, mask=None):
        later = keras.ops.arange(keras.ops.shape(inputs)[1]) > 0
        return later[None, :] if mask is None else keras.ops.logical_and(mask, later[None, :])


def _data():
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(1, T + 1, size=ROWS))
    padded = np.arange(T)[None, :] >= lengths[:, None]
    tokens = rng.integers(1, 9, size=(ROWS, T))
    tokens[padded] = 0
    series = rng.normal(size=(ROWS, T, 2)).astype("float32")
    series[padded] = 0.0
    y = rng.normal(size=(ROWS, T, 1)).astype("float32")
    return {"tokens": tokens, "series": series}, [y, y[..., ::-1] * 2]


def _model():
    keras.utils.set_random_seed(1)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    series = keras.Input((T, 2), name="series")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
    h = keras.layers.Dense(3, activation="tanh")(h)
    words = keras.layers.TimeDistributed(keras.layers.Dense(1), name="words")(h)
    g = SkipFirstStep()(keras.layers.Masking(0.0)(series))
    g = keras.layers.Dense(3, activation="tanh")(g)
    steps = keras.layers.Dense(1, name="steps")(g)
    return keras.Model({"tokens": tokens, "series": series}, [words, steps])


def _run(shard=False):
    """(initial weights, trained weights, History, evaluate's scores): one device with
    ``shard`` False, else kmgpu on 2 devices with that ``shard`` value."""
    x, y = _data()
    model = _model()
    before = model.get_weights()
    target = model if shard is False else kmgpu.parallelize(model, gpus=2, shard=shard)
    target.compile(optimizer=keras.optimizers.Adam(0.05), loss=["mse", "mae"],
                   metrics=[["mae"], ["mse"]])
    history = target.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    scores = target.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return before, model.get_weights(), history.history, scores


@pytest.fixture(scope="module")
def one():
    return _run()


@pytest.fixture(scope="module", params=shard_values(), ids=lambda s: f"shard={s}")
def runs(request, one):
    return {"one": one, "kmgpu": _run(request.param)}


def test_masked_sequence_losses_train_as_on_one_device(runs):
    before, one, _, _ = runs["one"]
    assert rel_diff(before, one) > 1e-2
    assert rel_diff(one, runs["kmgpu"][1]) <= TOL


def test_masked_losses_and_metrics_report_as_on_one_device(runs):
    for one, got in ((runs["one"][2], runs["kmgpu"][2]), (runs["one"][3], runs["kmgpu"][3])):
        assert sorted(one) == sorted(got)
        for key in one:
            np.testing.assert_allclose(got[key], one[key], rtol=TOL, err_msg=key)

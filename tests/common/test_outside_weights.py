"""What Keras keeps beside a model's config and weights reaches the replicas: adapted
preprocessing layers (Normalization; on TensorFlow also StringLookup, IntegerLookup,
TextVectorization, Discretization, Hashing, whose string tables only TensorFlow runs
inside a model) and an optimizer's weight-decay exclusions (by variables and by
names). One model holds them all; ``GPUS`` devices train and predict as one device does.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import one_device_input, rel_diff

TOL = 1e-5
ROWS, BATCH = 78, 8  # 10 steps; the last batch of 6 rows splits 2, 2, 1, 1 (3, 3 on 2)
TF = keras.backend.backend() == "tensorflow"
#: what reaches the replicas is the same on any count: 2 on TensorFlow (half the tracing
#: of 4), 4 on JAX and torch
GPUS = 2 if TF else 4


def _data():
    rng = np.random.default_rng(0)
    x = {"num": (rng.normal(size=(ROWS, 3)) * 5 + 3).astype("float32")}
    if TF:
        x["tok"] = np.array([["a", "b", "c", "d"][i % 4] for i in range(ROWS)])[:, None]
        x["text"] = np.array([["a b c", "b c d", "c d e", "d e f"][i % 4] for i in range(ROWS)])
        x["int"] = (np.arange(ROWS) % 7 * 3)[:, None].astype("int64")
    y = (x["num"][:, :1] * 0.3 + rng.normal(size=(ROWS, 1))).astype("float32")
    return x, y


def _model(x):
    """Inputs by name; each adapted layer's output feeds one Dense, so a replica with
    the wrong state trains other weights. Adapted here, before kmgpu sees the model."""
    keras.utils.set_random_seed(1)
    num = keras.Input((3,), name="num")
    normalization = keras.layers.Normalization()
    normalization.adapt(x["num"])
    parts = [normalization(num)]
    inputs = {"num": num}
    if TF:
        discretization = keras.layers.Discretization(num_bins=4, output_mode="multi_hot")
        discretization.adapt(x["num"])
        inputs.update(tok=keras.Input((1,), dtype="string", name="tok"),
                      text=keras.Input((), dtype="string", name="text"),
                      int=keras.Input((1,), dtype="int64", name="int"))
        lookup = keras.layers.StringLookup(output_mode="one_hot")
        lookup.adapt(x["tok"])
        text = keras.layers.TextVectorization(output_mode="multi_hot")
        text.adapt(x["text"])
        integers = keras.layers.IntegerLookup(output_mode="one_hot")
        integers.adapt(x["int"])
        hashing = keras.layers.Hashing(num_bins=5, output_mode="one_hot", salt=7)
        parts += [discretization(num), lookup(inputs["tok"]), text(inputs["text"]),
                  integers(inputs["int"]), hashing(inputs["tok"])]
    h = keras.layers.Concatenate()([keras.ops.cast(p, "float32") for p in parts])
    h = keras.layers.Dense(4, name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(h))


def _optimizer(model):
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_list=[model.get_layer("hidden").kernel],
                                        var_names=["bias"])
    return optimizer


def _feed(x, y=None):
    if not TF:
        return dict(x=x) if y is None else dict(x=x, y=y)
    import tensorflow as tf  # string arrays reach a model through tf.data

    data = (x,) if y is None else (x, y)
    return dict(x=tf.data.Dataset.from_tensor_slices(data).batch(BATCH))


def _one_device_feed(x, y=None):
    return {k: one_device_input(v) for k, v in _feed(x, y).items()}


@pytest.fixture(scope="module")
def runs():
    x, y = _data()
    out = {}
    for name in ("one", "kmgpu"):
        model = _model(x)
        before = model.get_weights()
        target = model if name == "one" else kmgpu.parallelize(model, gpus=GPUS)
        feed = _feed if name == "kmgpu" else _one_device_feed
        out[name, "predict"] = target.predict(**feed(x), batch_size=None if TF else BATCH,
                                              verbose=0)
        target.compile(optimizer=_optimizer(model), loss="mse")
        kwargs = {} if TF else dict(batch_size=BATCH)
        history = target.fit(**feed(x, y), epochs=2, shuffle=False, verbose=0, **kwargs)
        out[name, "before"], out[name, "after"] = before, model.get_weights()
        out[name, "loss"] = history.history["loss"]
    return out


def test_adapted_layers_predict_as_on_one_device(runs):
    np.testing.assert_allclose(runs["kmgpu", "predict"], runs["one", "predict"], rtol=TOL,
                               atol=1e-6)


def test_adapted_layers_and_weight_decay_exclusions_train_as_on_one_device(runs):
    assert rel_diff(runs["one", "before"], runs["one", "after"]) > 1e-2
    assert rel_diff(runs["one", "after"], runs["kmgpu", "after"]) <= TOL
    np.testing.assert_allclose(runs["kmgpu", "loss"], runs["one", "loss"], rtol=TOL)

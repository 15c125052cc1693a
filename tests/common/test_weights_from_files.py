"""A model whose weights come from a file trains under kmgpu as on one device: a
``.weights.h5`` and Keras's sharded weights (``save_weights(..., max_shard_size=...)``, an
index and several ``.weights.h5`` shards), loaded into a model built under
``keras.device("cpu")``, then ``shard="weights"`` on the 4 simulated devices (TensorFlow,
which does not shard: unsharded). Weights to 1e-5 and every History entry against the
same file's weights trained by plain Keras on one device."""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import assert_trained_alike, rel_diff

TOL = 1e-5
ROWS, BATCH = 84, 8  # 11 steps, the last of 4 rows


def _model(seed):
    keras.utils.set_random_seed(seed)
    with keras.device("cpu"):
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(2)])
    return model


def _fit(target):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = np.stack([x[:, :3].sum(axis=1), np.sin(x[:, 3])], axis=1).astype("float32")
    return target.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history


def _saved(kind, folder):
    """The path of ``_model(1)``'s weights saved as ``kind``."""
    source = _model(1)
    if kind == "h5":
        path = folder / "model.weights.h5"
        source.save_weights(path)
    else:
        path = folder / "model.weights.json"
        source.save_weights(path, max_shard_size=2e-6)  # about 2 KB a shard
        assert len(list(folder.glob("model_*.weights.h5"))) > 1
    return path


@pytest.mark.parametrize("kind", ["h5", "sharded"])
def test_weights_loaded_from_a_file_train_as_on_one_device(kind, tmp_path):
    path = _saved(kind, tmp_path)
    reference = _model(7)
    reference.load_weights(path)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    expected = _fit(reference)

    model = _model(7)  # other initial values: only the file can make them equal
    model.load_weights(path)
    shard = None if keras.backend.backend() == "tensorflow" else "weights"
    parallel = kmgpu.parallelize(model, shard=shard)
    parallel.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    assert parallel.num_replicas == 4
    history = _fit(parallel)
    assert rel_diff(reference.get_weights(), model.get_weights()) <= TOL
    assert history.keys() == expected.keys()
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=TOL, atol=1e-7, err_msg=key)


def test_a_keras_hub_preset_trains_as_on_one_device(tmp_path):
    """A keras-hub causal LM saved with ``save_to_preset`` and loaded with ``from_preset``
    under ``keras.device("cpu")`` (the preset's weights file read into the CPU model), then
    sharded: as the same preset trained by plain Keras on one device."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16, dropout=0.0)
    keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None).save_to_preset(
        str(tmp_path))

    def load():
        with keras.device("cpu"):
            model = keras_hub.models.CausalLM.from_preset(str(tmp_path))
        model.compile(optimizer=keras.optimizers.Adam(0.01), weighted_metrics=["accuracy"])
        return model

    ids = np.random.default_rng(3).integers(1, 40, size=(ROWS, 9)).astype("int32")
    x, y = {"token_ids": ids[:, :-1], "padding_mask": np.ones((ROWS, 8), bool)}, ids[:, 1:]
    fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    reference = load()
    expected = reference.fit(x, y, **fit).history
    model = load()
    before = model.get_weights()
    shard = None if keras.backend.backend() == "tensorflow" else "weights"
    parallel = kmgpu.parallelize(model, shard=shard)
    history = parallel.fit(x, y, **fit).history
    assert parallel.num_replicas == 4
    assert rel_diff(before, model.get_weights()) > 1e-3, "the model did not train"
    assert_trained_alike(reference, model, TOL)  # its attention key biases to 1e-3
    assert history.keys() == expected.keys()
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=TOL, atol=1e-6, err_msg=key)

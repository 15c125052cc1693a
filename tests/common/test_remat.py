"""A model built under ``keras.RematScope`` (activation checkpointing: the backward pass
recomputes a layer's activations instead of keeping them) trains under kmgpu as on one
device: weights to 1e-5 and every History entry, unsharded and with ``shard="weights"``
(TensorFlow does not shard: ``parallelize`` refuses ``shard="weights"`` with the engines
that do; nor does Keras's TensorFlow backend rematerialize a whole layer's call inside a
compiled step, ``_keras_cannot``). Remat changes what is kept, not the arithmetic.

On JAX the replica that trains keeps each layer's remat mode (its layers are made
outside the user's scope); the bytes it saves are measured by
``benchmarks/host_memory.py --remat``.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import rel_diff

TOL = 1e-5
ROWS, BATCH = 84, 8  # 11 steps, the last of 4 rows


def _model(mode):
    keras.utils.set_random_seed(3)
    with keras.RematScope(mode=mode):
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    return x, np.stack([x[:, :3].sum(axis=1), np.sin(x[:, 3])], axis=1).astype("float32")


def _fit(target):
    x, y = _data()
    return target.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history


_ONE_DEVICE = {}


def _one_device(mode):
    """Plain Keras's weights and History on one device (once per mode)."""
    if mode not in _ONE_DEVICE:
        model = _model(mode)
        history = _fit(model)
        _ONE_DEVICE[mode] = (model.get_weights(), history)
    return _ONE_DEVICE[mode]


def _keras_cannot(mode):
    """Keras 3.15's TensorFlow backend rematerializes through ``tf.recompute_grad``, whose
    ``custom_gradient`` takes keyword arguments only eagerly: a layer's whole call
    (``mode="full"``: ``call(inputs, training=...)``) fails inside a compiled step, on
    one device as under kmgpu. Its activations alone (positional) work."""
    return keras.backend.backend() == "tensorflow" and mode == "full"


@pytest.mark.parametrize("mode", ["full", "activations"])
@pytest.mark.parametrize("shard", [None, "weights"], ids=str)
def test_remat_equals_one_device(mode, shard):
    if _keras_cannot(mode):
        with pytest.raises(ValueError, match="supports keywords arguments only when eager"):
            _fit(_model(mode))
        return
    model = _model(mode)
    if shard is not None and keras.backend.backend() == "tensorflow":
        with pytest.raises(NotImplementedError, match="The JAX and torch backends shard"):
            kmgpu.parallelize(model, shard=shard)
        return
    parallel = kmgpu.parallelize(model, shard=shard)
    assert parallel.num_replicas == 4
    history = _fit(parallel)
    weights, expected = _one_device(mode)
    assert rel_diff(weights, model.get_weights()) <= TOL
    assert history.keys() == expected.keys()
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=TOL, atol=1e-7, err_msg=key)
    if keras.backend.backend() == "jax":  # the replica that trained rematerializes too
        replica = parallel._engine.replica
        modes = [layer._remat_mode for layer in replica._flatten_layers(include_self=True)]
        assert modes and all(m is not None and m.mode == mode for m in modes), modes

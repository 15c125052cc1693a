"""sync_batchnorm=True on TensorFlow: practical on deep models, and one device's moments.

Keras's ``synchronized=True`` took over 400 s to trace MobileNetV2 (alpha 0.35, 32x32)
on 4 replicas: tracing each all-reduce walked every replica's graph (quadratic in
depth). Its variance E[x^2] - E[x]^2 also loses float32 digits that one device's
two-pass moments keep (tests/common/test_sync_moments.py).
"""

import contextlib

import numpy as np

import kmgpu
from tests.helpers import few_steps, rel_diff


def _cnn(blocks=2, dtype="float32"):
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3), dtype=dtype)
    h = inputs
    for i in range(blocks):
        h = keras.layers.Conv2D(8 * (1 + i % 2), 3, padding="same", use_bias=False,
                                dtype=dtype)(h)
        h = keras.layers.BatchNormalization(dtype=dtype)(h)
        h = keras.layers.ReLU(dtype=dtype)(h)
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype)(h)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(h))


def test_tracing_walks_no_replica_graph():
    """No graph walk per all-reduce (Keras's: 92 for 4 layers, growing with depth). 2
    replicas: Keras's all-reduce walks on any count, and none is what this checks."""
    from tensorflow.python.ops import op_selector

    x = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype("float32")
    y = np.zeros((16, 3), "float32")
    model = _cnn(blocks=4)
    parallel = kmgpu.parallelize(model, gpus=2, sync_batchnorm=True)
    parallel.compile(optimizer="sgd", loss="mse")
    walk, walks = op_selector.get_backward_walk_ops, []

    def counting(*args, **kwargs):
        walks.append(1)
        return walk(*args, **kwargs)

    op_selector.get_backward_walk_ops = counting
    try:
        with few_steps():
            parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)
    finally:
        op_selector.get_backward_walk_ops = walk
    assert len(walks) == 0


def _fit(gpus):
    """Weights after 2 epochs (Adam, batch 32 of 128): one device, and kmgpu on ``gpus``
    replicas with synchronised BatchNorm, from the same start."""
    import keras

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(128, 8, 8, 3)) * 3 + 1).astype("float32")
    y = rng.normal(size=(128, 3)).astype("float32")
    fits = []
    for devices in (None, gpus):
        model = _cnn()
        target = model if devices is None else kmgpu.parallelize(
            model, gpus=devices, sync_batchnorm=True)
        target.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        with few_steps() if devices else contextlib.nullcontext():
            target.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        fits.append(model.get_weights())
    return fits


def test_sync_batchnorm_equals_one_device():
    """Moments over the global batch: per-replica moments of 8 rows each would be far
    from one device's."""
    one, parallel = _fit(gpus=4)
    assert rel_diff(one, parallel) <= 1e-5

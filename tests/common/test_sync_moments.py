"""``sync_batchnorm=True`` keeps the variance's float32 digits on every backend.

Features of mean 100 and standard deviation 3, 126 rows on 4 devices (32, 32, 31, 31
rows): with momentum 0 one step leaves the global batch's moments in the moving
statistics, and they are compared with float64. The variance is where moments lose
digits: E[x^2] - E[x]^2 subtracts two numbers near 10,009 and keeps about three of
float32's seven digits of a variance of 9. Keras's own synchronized layer on TensorFlow
computes it so; kmgpu computes the mean, then the squared differences from it
(TensorFlow), or combines each device's count, mean and squared differences (torch, as
torch's SyncBatchNorm does); on JAX Keras's own layer runs on the sharded global batch.

The moments themselves, not weights after training: Adam turns rounding in near-zero
gradients into full steps, so how far trained weights land from float64 depends on the
CPU's kernels, not on how the moments are computed.
"""

import keras
import numpy as np

import kmgpu
from tests.helpers import few_steps


def test_synced_moments_keep_float32_digits():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(126, 8, 8, 3)) * 3 + 100).astype("float32")
    y = rng.normal(size=(126, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    norm = keras.layers.BatchNormalization(momentum=0.0)
    h = keras.layers.GlobalAveragePooling2D()(norm(inputs))
    parallel = kmgpu.parallelize(keras.Model(inputs, keras.layers.Dense(1)(h)), gpus=4,
                                 sync_batchnorm=True)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=126, epochs=1, verbose=0)
    exact = x.astype("float64")
    for got, want in ((norm.moving_mean, exact.mean(axis=(0, 1, 2))),
                      (norm.moving_variance, exact.var(axis=(0, 1, 2)))):
        error = np.max(np.abs(np.asarray(got, "float64") - want) / want)
        assert error <= 1e-5, (got, want)

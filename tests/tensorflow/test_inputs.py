"""tf.data input through MirroredStrategy.

A PyDataset or generator through tf.distribute (plain Keras, no kmgpu) trains
nondeterministically from the second epoch on in Keras 3.15.1 / TF 2.21, so the
PyDataset parity test lives with the JAX and torch engines.
"""

import numpy as np

import kmgpu
from tests.helpers import data, few_steps, mlp, one_device_input, rel_diff

TOL = 1e-5


def test_tf_data_input():
    import tensorflow as tf

    x, y = data("mlp", 45)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(12)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(one_device_input(ds), epochs=2, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(ds, epochs=2, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    pred = parallel.predict(ds, verbose=0)
    np.testing.assert_allclose(pred, ref.predict(one_device_input(ds), verbose=0), rtol=1e-5,
                               atol=1e-6)

"""What a newcomer types as in plain Keras: an unbuilt Sequential (no Input) is built
from the first batch and trains as on one device."""

import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, rel_diff


def _unbuilt(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def test_an_unbuilt_sequential_trains_as_plain_keras_on_four_devices():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5))  # float64 as users pass it: Keras casts to float32
    y = x.sum(axis=1, keepdims=True).astype("float32")
    ref = _unbuilt()
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _unbuilt()
    parallel = kmgpu.parallelize(model, gpus=4)
    assert not model.built and "not built yet" in str(parallel.describe(print_fn=len))
    assert parallel.num_replicas == 4 and "first call" in repr(parallel)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.built and model.inputs[0].shape == (None, 5)  # any batch size predicts
    worst = rel_diff(ref.get_weights(), model.get_weights())
    print(f"unbuilt Sequential, 4 devices vs plain Keras: {worst:.2e}")
    assert worst <= 1e-5
    pred = parallel.predict(x[:7], verbose=0)
    np.testing.assert_allclose(pred, ref.predict(x[:7], verbose=0), rtol=1e-5, atol=1e-6)
    assert "per-replica batch  4" in parallel.describe(print_fn=len)
    parallel.close()


def test_an_unbuilt_sequential_is_built_by_predict_and_by_a_pydataset():
    from tests.helpers import row_batches

    x = np.random.default_rng(1).normal(size=(24, 3)).astype("float32")
    plain = _unbuilt(seed=2)
    expect = plain.predict(x, verbose=0)
    parallel = kmgpu.parallelize(_unbuilt(seed=2), gpus=2)
    np.testing.assert_allclose(parallel.predict(x, verbose=0), expect, rtol=1e-5, atol=1e-6)
    parallel.close()  # its workers, not left to a later test's resource count (test_soak)
    parallel = kmgpu.parallelize(_unbuilt(seed=2), gpus=2)
    out = parallel.predict(row_batches(x, np.zeros((24, 1), "float32"), size=8), verbose=0)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)
    parallel.close()

    def batches():
        yield x[:8], x[:8, :1]

    parallel = kmgpu.parallelize(_unbuilt(), gpus=2)
    with pytest.raises(ValueError, match="generator can be read only once.*keras.Input"):
        parallel.predict(batches(), verbose=0)
    parallel.close()

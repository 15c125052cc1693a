"""Parity: N replicas through kmgpu train exactly like one device (the core promise)."""

import numpy as np
import pytest

import kmgpu
from tests.helpers import MODELS, data, few_steps, rel_diff

TOL = 1e-5


def _reference(kind, optimizer, x, y, batch_size, epochs=2):
    import keras

    ref = MODELS[kind]()
    ref.compile(optimizer=keras.optimizers.get(optimizer), loss="mse")
    ref.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return ref


#: (model, optimizer, devices): each model on 2 and on 4 devices, each optimizer on 2 and on
#: 4, each model with both optimizers. The device count decides how the batch, the gradient
#: and BatchNorm's moments are split and summed, which depends on the model; the optimizer
#: then updates the all-reduced gradient whatever the count: the other 6 of the 12
#: combinations would repeat what these fits show.
CASES = [("mlp", "sgd", 2), ("mlp", "adam", 4), ("conv_bn", "sgd", 4),
         ("conv_bn", "adam", 2), ("lstm", "sgd", 2), ("lstm", "adam", 4)]


@pytest.mark.parametrize("kind,optimizer,n", CASES)
def test_weights_equal_one_device(kind, optimizer, n):
    x, y = data(kind, 64)
    ref = _reference(kind, optimizer, x, y, batch_size=16)
    model = MODELS[kind]()
    before = [w.copy() for w in model.get_weights()]
    parallel = kmgpu.parallelize(model, gpus=n, sync_batchnorm=(kind == "conv_bn"))
    parallel.compile(optimizer=optimizer, loss="mse")
    with few_steps():
        history = parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert parallel.num_replicas == n
    assert rel_diff(before, model.get_weights()) > 1e-3, "the user's model did not train"
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert len(history.history["loss"]) == 2
    assert history.history["loss"][-1] == pytest.approx(ref.history.history["loss"][-1],
                                                        rel=1e-4)


@pytest.mark.parametrize("kind", ["mlp", "conv_bn"])
def test_sizes_that_do_not_divide(kind):
    """97 samples, batch 20, 3 devices: the first batches split 7/7/6, the last has 17."""
    x, y = data(kind, 97)
    ref = _reference(kind, "adam", x, y, batch_size=20)
    model = MODELS[kind]()
    parallel = kmgpu.parallelize(model, gpus=3, sync_batchnorm=True)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])  # same metrics for evaluate
    with few_steps():
        parallel.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL

    pred = parallel.predict(x, batch_size=20, verbose=0)
    assert pred.shape[0] == 97
    np.testing.assert_allclose(pred, ref.predict(x, batch_size=20, verbose=0), rtol=1e-5, atol=1e-6)
    got = parallel.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    want = ref.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


@pytest.mark.parametrize("samples,batch", [(5, 3), (2, 8), (101, 30)])
def test_small_and_partial_batches_predict_every_row_in_order(samples, batch):
    """Batches smaller than the device count, and a last batch of 11 on 4 devices."""
    x, y = data("mlp", samples)
    model = MODELS["mlp"]()
    want = model.predict(x, batch_size=batch, verbose=0)
    parallel = kmgpu.parallelize(model, gpus=4)
    got = parallel.predict(x, batch_size=batch, verbose=0)
    assert got.shape == (samples, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    parallel.compile(optimizer="sgd", loss="mse")
    ref = _reference("mlp", "sgd", x, y, batch_size=batch, epochs=1)
    with few_steps():
        parallel.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL

"""evaluate and predict cost no more than plain Keras's: kmgpu does not scan their
x for NaN/inf (on one H200 the scan of ResNet-50's 4,096 64x64 rows was a large part of
kmgpu's evaluate at 0.63x plain), still refuses a NaN label, and a NaN in x shows in the
loss as with plain Keras; on one device evaluate and predict are the model's own."""

import numpy as np
import pytest

import kmgpu
from kmgpu import checks
from tests.helpers import data, mlp, one_device


@pytest.fixture(scope="module")
def pair():
    x, y = data("mlp", 40)
    plain = mlp()
    plain.compile(optimizer="adam", loss="mse")
    model = mlp()
    with one_device():
        parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(optimizer="adam", loss="mse")
    return plain, parallel, x, y


@pytest.fixture
def scanned(monkeypatch):
    paths = []
    finite = checks._finite
    monkeypatch.setattr(checks, "_finite", lambda path, leaf: (paths.append(path),
                                                              finite(path, leaf)))
    return paths


def test_evaluate_and_predict_scan_no_x(pair, scanned):
    plain, parallel, x, y = pair
    loss = parallel.evaluate(x, y, batch_size=8, verbose=0)
    assert scanned == ["y"]  # the labels only
    assert loss == plain.evaluate(x, y, batch_size=8, verbose=0)  # same weights: same loss
    np.testing.assert_array_equal(parallel.predict(x, batch_size=8, verbose=0),
                                  plain.predict(x, batch_size=8, verbose=0))
    assert scanned == ["y"]
    parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)  # fit scans what trains
    assert scanned == ["y", "x", "y"]


def test_one_device_compiles_once_and_reuses_the_model_own_functions(pair):
    from kmgpu.engines.local import LocalEngine

    _, parallel, x, y = pair
    assert type(parallel._engine) is LocalEngine  # no step of kmgpu's own: Keras's
    model = parallel.model
    parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)
    parallel.evaluate(x, y, batch_size=8, verbose=0)
    parallel.predict(x, batch_size=8, verbose=0)
    functions = (model.train_function, model.test_function, model.predict_function)
    assert all(functions)
    parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)
    parallel.evaluate(x, y, batch_size=8, verbose=0)
    parallel.predict(x, batch_size=8, verbose=0)
    assert (model.train_function, model.test_function, model.predict_function) == functions


def test_nan_in_x_shows_in_the_loss_as_plain_keras_and_nan_labels_are_refused(pair):
    plain, parallel, x, y = pair
    bad = x.copy()
    bad[3, 0] = np.nan
    assert np.isnan(parallel.evaluate(bad, y, verbose=0))
    assert np.isnan(plain.evaluate(bad, y, verbose=0))
    labels = y.copy()
    labels[5] = np.nan
    with pytest.raises(ValueError, match=r"y holds NaN values in 1 of 40 rows \(first: row 5\)"):
        parallel.evaluate(x, labels, verbose=0)

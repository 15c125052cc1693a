"""On a Keras outside the tested range (pyproject.toml's ``dependencies``, ``KERAS`` of the
registries) kmgpu warns once per process, naming the range, and runs."""

import warnings

import keras
import pytest

import kmgpu
from kmgpu import versions
from kmgpu.engines import keras_fixes


@pytest.fixture
def fresh(monkeypatch):
    """No warning given yet in this process; the test sets keras.__version__."""
    monkeypatch.setattr(versions, "_warned", False)
    return monkeypatch


def test_outside_the_range_warns_once_naming_it(fresh):
    fresh.setattr(keras, "__version__", "3.99.0")
    with pytest.warns(UserWarning, match=r"kmgpu: Keras 3\.99\.0 is outside") as caught:
        versions.check_keras()
    assert keras_fixes.KERAS in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_keras()  # the second time: nothing


def test_inside_the_range_says_nothing(fresh):
    low = keras_fixes.KERAS.split(",")[0].lstrip(">=")
    fresh.setattr(keras, "__version__", low + ".0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_keras()
    assert not versions._warned


def _version_warnings(caught):
    return [w for w in caught if "outside the Keras releases" in str(w.message)]


def test_parallelize_warns_once_and_runs(fresh):
    """Where the engine is chosen (connector.connect): the first parallelize warns, the
    model still trains, the next parallelize is silent about it."""
    import numpy as np

    fresh.setattr(keras, "__version__", "3.99.0")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # one device also warns, as it does anywhere
        parallel = kmgpu.parallelize(model, gpus=1)
    assert len(_version_warnings(caught)) == 1
    assert "tested with (>=" in str(_version_warnings(caught)[0].message)
    parallel.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few steps per epoch: not what this test is about
        history = parallel.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kmgpu.parallelize(model, gpus=1)
    assert not _version_warnings(caught)

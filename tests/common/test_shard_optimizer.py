"""``shard_optimizer=``: validated, refused up front where the backend has no sharded
optimizer (TensorFlow), a no-op said once on one device. Parity and memory:
``tests/jax/test_zero.py``, ``tests/torch/test_zero.py``."""

import numpy as np
import pytest

import kmgpu
from kmgpu import hardware
from tests.helpers import mlp


def test_not_a_bool_is_refused():
    with pytest.raises(TypeError, match="shard_optimizer must be True or False"):
        kmgpu.parallelize(mlp(), shard_optimizer="yes")


def test_refused_before_any_work_or_sharded():
    """TensorFlow refuses before any work; JAX and torch take it."""
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    if hardware.backend_name() in ("jax", "torch"):
        parallel = kmgpu.parallelize(model, shard_optimizer=True)
        assert "state: 1/4 per device (shard_optimizer=True)" in str(parallel.describe())
        for a, b in zip(before, model.get_weights()):
            assert np.array_equal(a, b)
        return
    with pytest.raises(NotImplementedError, match="MirroredStrategy has no sharded optimizer"
                       ) as e:
        kmgpu.parallelize(model, shard_optimizer=True)
    assert "The JAX and torch backends have it" in str(e.value)
    assert not model.optimizer.built  # nothing ran: no optimizer state was made
    for a, b in zip(before, model.get_weights()):
        assert np.array_equal(a, b)


def test_an_unbuilt_model_is_checked_up_front_too():
    """An unbuilt Sequential is built at its first batch; shard_optimizer is judged at wrap."""
    import keras

    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    if hardware.backend_name() in ("jax", "torch"):
        parallel = kmgpu.parallelize(model, shard_optimizer=True)
        assert not model.built and parallel.num_replicas == 4
    else:
        with pytest.raises(NotImplementedError, match="The JAX and torch backends have it"):
            kmgpu.parallelize(model, shard_optimizer=True)
        assert not model.built

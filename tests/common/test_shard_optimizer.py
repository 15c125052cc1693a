"""``shard_optimizer=``: validated, refused up front where the backend has no sharded
optimizer (TensorFlow, torch for now), a no-op said once on one device. JAX's parity and
memory: ``tests/jax/test_zero.py``."""

import numpy as np
import pytest

import kmgpu
from kmgpu import hardware
from tests.helpers import mlp, one_device


def test_not_a_bool_is_refused():
    with pytest.raises(TypeError, match="shard_optimizer must be True or False"):
        kmgpu.parallelize(mlp(), shard_optimizer="yes")


@pytest.mark.skipif(hardware.backend_name() == "jax", reason="JAX shards the optimizer")
def test_refused_before_any_work():
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    want = ("MirroredStrategy has no sharded optimizer" if hardware.backend_name() == "tensorflow"
            else "not yet available on the torch backend")
    with pytest.raises(NotImplementedError, match=want) as e:
        kmgpu.parallelize(model, shard_optimizer=True)
    assert "JAX backend" in str(e.value)
    assert not model.optimizer.built  # nothing ran: no optimizer state was made
    for a, b in zip(before, model.get_weights()):
        assert np.array_equal(a, b)


@pytest.mark.skipif(hardware.backend_name() != "jax", reason="only JAX shards the optimizer")
def test_one_device_is_a_no_op_said_once():
    with one_device(), pytest.warns(UserWarning, match="kmgpu: shard_optimizer=True on one "
                                                       "device: nothing to shard") as seen:
        parallel = kmgpu.parallelize(mlp(), gpus=1, shard_optimizer=True)
    assert parallel.num_replicas == 1
    assert sum("shard_optimizer" in str(w.message) for w in seen) == 1

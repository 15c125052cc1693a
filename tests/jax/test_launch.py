"""``kmgpu launch`` with JAX: 2 hosts x 1 process on 127.0.0.1 through
``jax.distributed`` (keras.distribution.initialize).

One launch serves every test (each launch starts two JAX processes: seconds of imports
and compiles): each process first fits with ``shard_optimizer=True`` and with
``shard="weights"`` (tests/jax/zero_launch.py), then runs tests/launch/train.py, which
every backend's launch test runs, until one process is killed.
"""

import os

import pytest

from tests.launch import nodes

TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("launch"))
    script = os.path.join(os.path.dirname(__file__), "zero_launch.py")
    found = nodes.parity_then_kill("jax", out, script=script)
    found["zero"] = nodes.results(out, "zero")
    return found


def test_two_hosts_match_one_process_and_stop_when_one_dies(run):
    assert run["seconds_to_fail"] < 60
    assert "jax.distributed" in run["results"][0]["engine"]


def test_shard_optimizer_over_two_processes(run):
    """``shard_optimizer=True`` (tests/jax/test_zero.py) on 2 "hosts" x 1 process (one
    CPU device each): each process holds half of every slot that splits over 2, and the
    user's model gets the whole state back."""
    assert len(run["zero"]) == 2
    for r in run["zero"]:
        assert r["replicas"] == 2
        assert r["weights"] <= TOL and r["optimizer"] <= TOL, r
        per_device, whole, kept = r["bytes"]
        assert r["bytes"] == r["planned"] and per_device == (whole - kept) // 2 + kept, r
        assert per_device < 0.6 * whole, r


def test_shard_weights_over_two_processes(run):
    """``shard="weights"`` (tests/jax/test_shard.py) in the same launch: each process holds
    half of every weight that splits over 2 (and of its slots), the fit and predict equal
    one process, and the user's model gets the whole state back."""
    assert len(run["zero"]) == 2
    for r in run["zero"]:
        f = r["fsdp"]
        assert f["weights"] <= TOL and f["optimizer"] <= TOL and f["predict"] <= TOL, f
        per_device, whole, kept = f["bytes"]
        assert f["bytes"] == f["planned"] and per_device == (whole - kept) // 2 + kept, f
        assert per_device < 0.6 * whole, f

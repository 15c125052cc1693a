"""``kmgpu launch`` with torch: torchrun on 2 hosts x 2 processes on 127.0.0.1 (gloo),
kmgpu's torch engine in-process on each rank.

One launch serves every test (each starts four torch processes: seconds of imports):
each process first trains a conv + BatchNorm model and checks it against one process
(tests/torch/torchrun_parity.py), then runs tests/launch/train.py, which every backend's
launch test runs, until one process is killed. So each process holds two models when a
peer dies: the second one's failed call must keep the first (which started the process
group) from a barrier at exit, or the host would not stop in time.
"""

import os

import pytest

from tests.launch import nodes

TOL = 1e-5
WORLD = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("launch"))
    script = os.path.join(os.path.dirname(__file__), "torchrun_parity.py")
    found = nodes.parity_then_kill("torch", out, nproc=2, script=script)
    found["torchrun"] = nodes.results(out, "torchrun")
    return found


def test_two_hosts_of_two_match_one_process_and_stop_when_one_dies(run):
    assert run["seconds_to_fail"] < 60
    assert "in-process" in run["results"][0]["engine"]


def test_in_process_ranks_equal_one_process(run):
    """Each rank one gloo process of torchrun's: a conv + BatchNorm model with
    sync_batchnorm, every rank but 0 started from other weights (rank 0's broadcast),
    97 rows in batches of 20 (the last, 17, split 5 + 4 + 4 + 4)."""
    lines = run["torchrun"]
    assert len(lines) == WORLD
    for result in lines:
        assert result["replicas"] == WORLD and "in-process" in result["engine"]
        assert result["rel_diff"] <= TOL
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-5)
        assert result["pred_rows"] == 97 and result["pred_err"] < 1e-5
        for key, value in result["ref_eval"].items():
            assert result["eval"][key] == pytest.approx(value, rel=1e-5)
    # callbacks once, on rank 0
    assert sorted(r["callback_epochs"] for r in lines) == [[]] * (WORLD - 1) + [[0, 1]]
    assert all(max(r["stateful"]) <= 1e-5 for r in lines), lines  # state rows per rank

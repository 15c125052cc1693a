"""torchrun's ``--max-restarts`` through ``kmgpu launch`` with ``BackupAndRestore``: a
job whose process dies mid-fit is started again and resumes where the backup left it,
ending where an uninterrupted run ends (tests/launch/restart.py: one host, 2 processes,
process 0 killed as epoch 2 begins)."""

import json
import os

import pytest

from tests.launch import nodes

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch", "restart.py")


def test_a_restarted_job_resumes_exactly(tmp_path):
    out = str(tmp_path)
    job = nodes.start("torch", out, nnodes=1, nproc=2, script=SCRIPT,
                      options=("--max-restarts", "1"), KMGPU_COLLECTIVE_TIMEOUT="60")
    try:
        codes = nodes.wait(job, 240)
        assert codes == [0], (codes, nodes.logs(out))
        with open(os.path.join(out, "restart.json")) as f:
            result = json.load(f)
    finally:
        nodes.cleanup(job, out)
    assert result["attempt"] == 1  # torchrun started the job a second time
    assert result["rel_diff"] <= 1e-5, result
    # the CSV (appended by both attempts) is the uninterrupted run's History; the
    # resumed fit's own History holds the epochs it ran
    assert result["csv_epochs"] == [0, 1, 2, 3]
    assert result["csv_loss"] == pytest.approx(result["ref_loss"], rel=1e-5)
    assert result["epochs"] == [2, 3]
    assert result["loss"] == pytest.approx(result["ref_loss"][2:], rel=1e-5)

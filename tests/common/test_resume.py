"""``BackupAndRestore`` and ``kmgpu.ShardedCheckpoint`` across processes: a process on 4
simulated devices is killed after epoch 2 of 3 (tests/launch/resume.py), and a new process
resumes from its checkpoint on 4 devices, another on 2: under every ``shard`` value the
backend takes, each ends equal to 3 uninterrupted epochs on one device (weights within
1e-5, the resumed History)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import shard_values

TOL = 1e-5
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch", "resume.py")


def _run(*args):
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    env.pop("KMGPU_SIMULATE_DEVICES", None)  # the script says how many
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    killed = _run("kill", 4, out / "backups")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    found = {}
    for n in (4, 2):  # each resumes from its own copy: a resumed fit deletes its backup
        shutil.copytree(out / "backups", out / f"on{n}")
        done = _run("resume", n, out / f"on{n}")
        assert done.returncode == 0, done.stderr[-3000:]
        found[n] = json.load(open(out / f"on{n}" / f"resume{n}.json"))
    return found


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.parametrize("shard", shard_values(), ids=str)
@pytest.mark.parametrize("callback", ["backup", "sharded"])
def test_a_killed_fit_resumes_in_a_new_process_exactly(resumed, callback, shard, n):
    r = resumed[n]
    s = r["shards"][f"{callback}-{shard}"]
    assert s["replicas"] == n
    assert s["epoch"] == [2]  # epochs 1 and 2 were done by the killed process
    assert s["rel_diff"] <= TOL, s
    np.testing.assert_allclose(s["loss"], r["ref_loss"][2:], rtol=TOL)

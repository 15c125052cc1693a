"""Keras's checkpoint callbacks and ``kmgpu.ShardedCheckpoint`` inside a 2-process ``kmgpu
launch`` job (2 "hosts" x 1 process on 127.0.0.1, one CPU device each), under every
``shard`` value the backend takes (tests/launch/checkpoints.py): the job finishes, process 0
alone writes Keras's files, they load into a plain Keras model equal to one process (the
``.keras`` files and the sharded checkpoint with the whole optimizer state), and a new job
resumes from the backup, and from the sharded checkpoint, exactly. Every process takes
part in the same collectives, so no process waits for another.
"""

import os

import keras
import numpy as np
import pytest

from kmgpu import checkpoints
from tests.helpers import data, mlp, optimizer_state, rel_diff, shard_values
from tests.launch import nodes

TOL = 1e-5
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch", "checkpoints.py")


def _job(out, phase):
    """Run one phase of the script as a 2-process job; what each process wrote."""
    started = nodes.start(keras.backend.backend(), out, script=SCRIPT, KMGPU_TEST_PHASE=phase)
    try:
        codes = nodes.wait(started, 240)
        assert codes == [0, 0], (phase, codes, nodes.logs(out))
        return nodes.results(out, phase)
    finally:
        nodes.cleanup(started, out)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoints")
    saved = _job(out, "save")
    return out, saved, _job(out, "resume")


def _reference(epochs):
    x, y = data("mlp", 64)
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("shard", shard_values(), ids=str)
def test_checkpoints_of_a_job_load_into_plain_keras(jobs, shard):
    out, saved, _ = jobs
    assert len(saved) == 2
    for r in saved:
        s = r["shards"][str(shard)]
        assert s["replicas"] == 2 and s["epoch"] == [0, 1] and s["rel_diff"] <= TOL, r
        np.testing.assert_allclose(s["loss"], r["ref_loss"], rtol=TOL)
    where = out / str(shard)
    assert sorted(p.name for p in where.iterdir()) == [
        "backup", "ep1.keras", "ep1.weights.h5", "ep2.keras", "ep2.weights.h5", "sharded"]
    ref = _reference(3)  # the resuming job saved its third epoch last
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    assert checkpoints.load(where / "sharded", model) == 2
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(optimizer_state(ref), optimizer_state(model)) <= TOL
    for epoch in (1, 2):
        ref = _reference(epoch)
        model = mlp()
        model.load_weights(str(where / f"ep{epoch}.weights.h5"))
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
        whole = keras.saving.load_model(str(where / f"ep{epoch}.keras"))
        assert rel_diff(ref.get_weights(), whole.get_weights()) <= TOL
        assert int(whole.optimizer.iterations) == 4 * epoch
        assert rel_diff(optimizer_state(ref), optimizer_state(whole)) <= TOL


@pytest.mark.parametrize("shard", shard_values(), ids=str)
@pytest.mark.parametrize("callback", ["backup", "sharded"])
def test_a_new_job_resumes_from_the_backup_exactly(jobs, callback, shard):
    _, _, resumed = jobs
    assert len(resumed) == 2
    for r in resumed:
        s = r["shards"][str(shard) if callback == "backup" else f"sharded-{shard}"]
        assert s["epoch"] == [2], r  # epochs 1 and 2 were done by the first job
        assert s["rel_diff"] <= TOL, r  # equal to 3 uninterrupted epochs in one process
        np.testing.assert_allclose(s["loss"], r["ref_loss"][2:], rtol=TOL)

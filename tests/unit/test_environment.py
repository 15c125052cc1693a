"""``kmgpu launch``'s argument checks and the job detection of ``kmgpu.environment``:
backend-neutral, so they run in every backend's session.
"""

import json
import os

import pytest

from kmgpu import environment
from kmgpu.commands import launch


@pytest.mark.parametrize("argv, words", [
    (["--nnodes", "0", "x.py"], "--nnodes 0"),
    (["--nnodes", "2", "--node-rank", "2", "x.py"], "from 0 to 1"),
    (["--node-rank", "-1", "x.py"], "its own index"),
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0"),
    (["--master-port", "70000", "x.py"], "free TCP port"),
    (["missing_script.py"], "not found"),
])
def test_bad_arguments_say_what_to_do(argv, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    with pytest.raises(ValueError, match=words.replace("-", r"\-")):
        launch.parse_args(argv)


def test_cli_turns_bad_arguments_into_a_usage_error(capsys):
    from kmgpu.commands import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--nnodes", "2", "--node-rank", "5", "train.py"])
    assert e.value.code == 2
    assert "give each host its own index" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["launch"])  # no script: argparse says it is required


def test_torch_gets_torchruns_own_command_line(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    args = launch.parse_args(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
                              "--master-addr", "10.0.0.1", "--master-port", "1234",
                              str(script), "--lr", "0.1"])
    assert launch.torchrun_argv(args) == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
        "--nproc-per-node", "4", "--master-addr", "10.0.0.1", "--master-port", "1234",
        str(script), "--lr", "0.1"]


def test_tf_config_names_every_worker_once():
    config = json.loads(environment.tf_config(["h0", "h1"], 2, 3, 5000))
    assert config == {"cluster": {"worker": ["h0:5001", "h0:5002", "h1:5003", "h1:5004"]},
                      "task": {"type": "worker", "index": 3}}


def test_job_from_torchrun_and_slurm_variables():
    assert environment.job({}) is None
    torchrun = environment.job({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "9"})
    assert (torchrun.rank, torchrun.world, torchrun.local_rank, torchrun.master_addr,
            torchrun.master_port) == (3, 4, 1, "a", 9)
    slurm = environment.job({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_STEP_NODELIST": "gpu[01-03,07]"})
    assert (slurm.rank, slurm.world, slurm.local_world, slurm.master_addr, slurm.source) == (
        5, 8, 2, "gpu01", "slurm")
    assert environment.job({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # sbatch, not srun
    assert environment.expand_hostlist("a,b[1-2],c[08-10]x") == ["a", "b1", "b2", "c08x", "c09x",
                                                             "c10x"]


def test_other_processes_drop_writers_and_keep_restoring(monkeypatch, tmp_path):
    import keras

    ckpt = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    stop = keras.callbacks.EarlyStopping()
    call = {"verbose": "auto", "callbacks": [ckpt, backup, stop]}
    assert environment.for_this_process(call) is call  # no job: process 0
    monkeypatch.setenv("RANK", "1")
    for key, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    mine = environment.for_this_process(call)
    assert mine["verbose"] == 0 and mine["callbacks"] == [backup, stop]
    backup._save_model()  # writes nothing here: process 0 keeps the backup
    assert not os.path.exists(backup._weights_path) and backup.delete_checkpoint is False

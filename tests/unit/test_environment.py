"""``kmgpu launch``'s argument checks and the job detection of ``kmgpu.environment``:
backend-neutral, so scripts/test.sh runs them in one backend's session.
"""

import ast
import json
import pathlib

import numpy as np
import pytest

from kmgpu import environment
from kmgpu.commands import launch

pytestmark = pytest.mark.backend_neutral  # the same files in every backend's session


@pytest.mark.parametrize("argv, words", [
    (["--nnodes", "0", "x.py"], "--nnodes 0"),
    (["--nnodes", "2", "--node-rank", "2", "x.py"], "from 0 to 1"),
    (["--node-rank", "-1", "x.py"], "its own index"),
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0"),
    (["--nproc-per-node", "all", "x.py"], "'gpu'"),
    (["--max-restarts", "-1", "x.py"], "--max-restarts -1"),
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
        "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
        "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234",
        "-m", "kmgpu.commands.launch", str(script), "--lr", "0.1"]
    args.max_restarts = 3  # restarts: torchrun's c10d rendezvous at the same address
    assert launch.torchrun_argv(args)[6:14] == [
        "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:1234",
        "--rdzv-id", "kmgpu-1234"]


def test_processes_per_host_torch_one_per_gpu_the_others_one():
    """torch: torchrun's one process per local GPU unless told, 1 without GPUs;
    TensorFlow and JAX: one process per host (it uses every local GPU)."""
    per_host = launch.processes_per_host
    assert per_host("torch", None, local_gpus=8) == "gpu"
    assert per_host("torch", "gpu", local_gpus=8) == "gpu"
    assert per_host("torch", None, local_gpus=0) == 1
    assert per_host("torch", 2, local_gpus=8) == 2
    assert per_host("torch", 3, max_restarts=2, local_gpus=0) == 3
    with pytest.raises(ValueError, match="no GPU"):
        per_host("torch", "gpu", local_gpus=0)
    for backend in ("jax", "tensorflow"):
        assert per_host(backend, None) == 1 and per_host(backend, 2) == 2
        with pytest.raises(ValueError, match="every local GPU"):
            per_host(backend, "gpu")
        with pytest.raises(ValueError, match="BackupAndRestore"):
            per_host(backend, None, max_restarts=1)


@pytest.mark.parametrize("env, place", [
    ({}, (0, 1)),
    ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "9"}, (2, 4)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "n[1-4]"},
     (5, 8)),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1", "c:1"]},
                               "task": {"type": "worker", "index": 1}})}, (1, 3)),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
                               "task": {"type": "worker", "index": 1}})}, (2, 3)),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]},
                               "task": {"type": "worker", "index": 0}})}, (0, 1)),
])
def test_process_helpers_under_each_launchers_variables(env, place, monkeypatch):
    """kmgpu.process_index / process_count / is_main_process / main_process_only from
    torchrun's (and kmgpu launch's), SLURM's and TF_CONFIG's variables; one process
    without any (kmgpu's torch pool included). The launches of tests/*/test_launch.py
    check the same inside real jobs."""
    import kmgpu

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "TF_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (kmgpu.process_index(), kmgpu.process_count()) == place
    assert kmgpu.is_main_process() == (place[0] == 0)
    said = kmgpu.main_process_only(lambda text: text)("once")
    assert said == ("once" if place[0] == 0 else None)


def test_collective_timeout_reads_its_switch(monkeypatch):
    monkeypatch.delenv("KMGPU_COLLECTIVE_TIMEOUT", raising=False)
    assert environment.collective_timeout().total_seconds() == 600
    monkeypatch.setenv("KMGPU_COLLECTIVE_TIMEOUT", "45")
    assert environment.collective_timeout().total_seconds() == 45
    for bad in ("0", "soon"):
        monkeypatch.setenv("KMGPU_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="number of seconds"):
            environment.collective_timeout()


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


def test_other_processes_keep_writers_silent_and_restoring(monkeypatch, tmp_path):
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
    # every process keeps the same list, the writers wrapped: here they write nothing
    assert mine["verbose"] == 0 and len(mine["callbacks"]) == 3 and mine["callbacks"][2] is stop
    assert [w.writer for w in environment.writers(mine["callbacks"])] == [ckpt, backup]
    # process 0 wrote a backup (a plain fit, 2 epochs); here it is restored, never written
    keras.utils.set_random_seed(0)
    trained = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    trained.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    writer = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
    trained.fit(x, y, epochs=2, verbose=0, callbacks=[writer])
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "backup").iterdir()}
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    fresh.compile(optimizer="sgd", loss="mse")
    restore = mine["callbacks"][1]
    restore.set_model(fresh)
    restore.on_train_begin()
    for a, b in zip(fresh.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(a, b)
    for hook in (restore.on_epoch_end, restore.on_train_batch_end):
        hook(0, {"loss": 0.0})
    restore.on_train_end()
    saver = mine["callbacks"][0]
    saver.set_model(fresh)
    saver.on_train_begin()
    saver.on_epoch_end(0, {"loss": 0.0})
    assert not (tmp_path / "m.keras").exists()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "backup").iterdir()} == files
    monkeypatch.setenv("RANK", "0")  # process 0: the same list, its writers write
    ours = environment.for_this_process(call)
    assert ours["verbose"] == "auto" and len(ours["callbacks"]) == 3
    saver = ours["callbacks"][0]
    saver.set_model(fresh)
    saver.on_train_begin()
    saver.on_epoch_end(0, {"loss": 0.0})
    assert (tmp_path / "m.keras").exists()
    assert backup.delete_checkpoint is True  # the user's callback is as it was


# -- kmgpu's switches: one table, one reader ---------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[2]
#: modules another owner still has to route through ``environment.setting`` (empty when done)


def _strings(node):
    """The string constants inside an AST node."""
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def kmgpu_reads(source):
    """The ``KMGPU_*`` names ``source`` reads from ``os.environ`` (``os.environ.get``,
    ``os.getenv``, ``os.environ[...]``, ``... in os.environ``), its module-level names for
    them followed (``ENV = "KMGPU_X"``; a dict or tuple of them: every name in it)."""
    tree = ast.parse(source)
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = _strings(node.value)

    def names(arg):
        found = set(_strings(arg))
        for n in ast.walk(arg):
            if isinstance(n, ast.Name):
                found |= constants.get(n.id, set())
        return {s for s in found if s.startswith("KMGPU_")}

    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and _is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                read |= names(node.args[0])
        elif (isinstance(node, ast.Subscript) and _is_environ(node.value)
              and isinstance(node.ctx, ast.Load)):
            read |= names(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            read |= names(node.left)
    return read


def test_the_reader_check_sees_every_way_of_reading():
    source = ('import os\nENV = "KMGPU_A"\nNAMES = {"x": "KMGPU_B"}\n\n\ndef f(w):\n'
              '    os.environ.get(ENV)\n    os.environ.get(NAMES[w], "1")\n'
              '    os.getenv("KMGPU_C")\n    os.environ["KMGPU_D"]\n    "KMGPU_E" in os.environ\n'
              '    os.environ["KMGPU_F"] = "1"\n    os.environ.get("HOME")\n')
    assert kmgpu_reads(source) == {"KMGPU_A", "KMGPU_B", "KMGPU_C", "KMGPU_D", "KMGPU_E"}


def test_every_switch_is_read_through_environment_setting():
    """No module of kmgpu but environment.py reads a KMGPU_* variable from os.environ."""
    found = {}
    for path in sorted((ROOT / "kmgpu").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name == "kmgpu/environment.py":
            continue
        read = kmgpu_reads(path.read_text())
        if read:
            found[name] = sorted(read)
    assert not found, f"read environment.setting(name) instead of os.environ: {found}"


def test_the_settings_page_lists_every_switch_with_its_default():
    page = (ROOT / "docs" / "settings.md").read_text()
    for switch in environment.SWITCHES.values():
        default = "unset" if switch.default is None else f"`{switch.default}`"
        assert f"| `{switch.name}` | {default} |" in page, switch.name


def test_setting_reads_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("KMGPU_TORCH_RESIDENT", raising=False)
    monkeypatch.delenv("KMGPU_TORCH_TIMING", raising=False)
    assert environment.setting("KMGPU_TORCH_RESIDENT") == "1"
    assert environment.enabled("KMGPU_TORCH_RESIDENT")
    assert environment.setting("KMGPU_TORCH_TIMING") is None
    monkeypatch.setenv("KMGPU_TORCH_RESIDENT", "0")
    assert environment.setting("KMGPU_TORCH_RESIDENT") == "0"
    assert not environment.enabled("KMGPU_TORCH_RESIDENT")
    with pytest.raises(KeyError):
        environment.setting("KMGPU_NOT_A_SWITCH")


def test_gpus_is_set_aside_in_a_job_and_said_once_by_the_main_process(monkeypatch):
    import warnings

    from kmgpu import connector

    monkeypatch.setattr(connector, "_SAID", [])
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    assert connector._in_a_job([0, 2]) == [0, 2]  # one process: honoured
    job = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "9"}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert connector._in_a_job(2) is None  # process 1 says nothing
    monkeypatch.setattr(connector, "_SAID", [])
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="not applied in a job") as said:
        assert connector._in_a_job([0, 1]) is None
        assert connector._in_a_job(1) is None  # once
    assert len(said) == 1


def test_a_torch_rank_says_once_per_host_when_gpus_stay_idle(monkeypatch, capsys):
    from kmgpu.engines.torch import runtime

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    runtime._say_idle_gpus(8, local_rank=1)  # the host's other processes say nothing
    runtime._say_idle_gpus(2, local_rank=0)  # every GPU used
    assert capsys.readouterr().err == ""
    runtime._say_idle_gpus(8, local_rank=0)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "8 GPUs" in said[0] and "6 stay idle" in said[0]

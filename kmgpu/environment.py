"""Which process am I: the job this process belongs to, from its environment.

A multi-process job is started by ``kmgpu launch``, by torchrun (``RANK`` ...) or by
SLURM's ``srun`` (``SLURM_PROCID`` ...); ``job()`` reads which, ``process_index()``
says who prints and saves, ``for_this_process()`` trims a call for the others.
``process_index``, ``process_count``, ``is_main_process`` and ``main_process_only`` are
public (``kmgpu.process_index()`` ...): the user's own code acts once with them.
``tf_config`` and ``expand_hostlist`` turn host lists into what TensorFlow needs.
Simulated devices (``kmgpu.simulate_devices``) are part of the environment too:
child processes read their count from ``SIMULATE_ENV``.

kmgpu's own switches (``KMGPU_*``) are listed once, in ``SWITCHES`` (name, default, what it
does; docs/settings.md shows the same table), and read through one function, ``setting``
(``enabled`` for the switches that are on unless "0"): no other module reads them from
``os.environ`` (``tests/unit/test_environment.py`` checks both).

Nothing here imports a backend at module import time. A leaf: it imports nothing from
kmgpu, so the front and the engines (each backend's runtime and launchers) both read it
without an engine importing the front (``tests/unit/test_structure.py`` checks both).
"""

import json
import os
from dataclasses import dataclass
from typing import Optional

SIMULATE_ENV = "KMGPU_SIMULATE_DEVICES"


@dataclass(frozen=True)
class Switch:
    """One ``KMGPU_*`` environment variable kmgpu reads."""

    name: str
    default: Optional[str]  # None: unset
    what: str


#: every KMGPU_* variable kmgpu reads, by name (docs/settings.md lists the same)
SWITCHES = {s.name: s for s in (
    Switch(SIMULATE_ENV, None,
           "the simulated device count; kmgpu.simulate_devices(n) sets it so that torch "
           "workers and child processes see the same count"),
    Switch("KMGPU_TORCH_START", None,
           "how torch workers start: fork, spawn or forkserver; unset: fork where safe (a "
           "CPU, or CUDA not yet initialised in this process), else spawn"),
    Switch("KMGPU_TORCH_FUSED_BN", "1",
           "0: Keras's own BatchNormalization inside kmgpu's steps on CUDA instead of "
           "torch's fused kernel"),
    Switch("KMGPU_TORCH_FAST_DENSE", "1",
           "0: Keras's own Dense call instead of F.linear inside kmgpu's steps on CUDA"),
    Switch("KMGPU_TORCH_FAST_EINSUM", "1",
           "0: Keras's own EinsumDense call instead of F.linear inside kmgpu's steps on CUDA"),
    Switch("KMGPU_TORCH_FAST_LOSS", "1",
           "0: Keras's own sparse categorical cross-entropy instead of the contiguous "
           "(rows, classes) view, on CUDA"),
    Switch("KMGPU_TORCH_FAST_CONV", "1",
           "0: Keras's own convolutions and poolings (with their input copies), on CUDA"),
    Switch("KMGPU_TORCH_FAST_RNN", "1",
           "0: Keras's own loop for a masked GRU/LSTM instead of cuDNN over the compacted "
           "sequence, on CUDA"),
    Switch("KMGPU_TORCH_FUSED_ADAM", "1",
           "0: kmgpu's flat Adam update as ten elementwise passes instead of torch's "
           "fused Adam kernel (the same arithmetic)"),
    Switch("KMGPU_TORCH_FLAT_OPTIMIZER", "1",
           "0: Keras's own optimizer.apply in the captured step instead of kmgpu's flat "
           "optimizer"),
    Switch("KMGPU_TORCH_CAPTURE_UPDATE", "1",
           "0: graph B (optimizer, metrics) runs eagerly after the captured graph A (to "
           "measure the difference)"),
    Switch("KMGPU_TORCH_RESIDENT", "1",
           "0: a call's arrays are copied to the GPU whole before the first step, not in "
           "chunks beside the steps"),
    Switch("KMGPU_TORCH_TIMING", None,
           "set (any value): print where a torch call's time went, on the driver and on "
           "rank 0"),
    Switch("KMGPU_COLLECTIVE_TIMEOUT", "600",
           "seconds a process of a torch job waits for the others (a collective, joining "
           "the group) before it fails: after a process dies or hangs, the others stop "
           "within this bound"),
    Switch("KMGPU_BENCH_JIT_COMPILE", None,
           "1: kmgpu bench compiles its models with jit_compile=True"),
)}


def setting(name):
    """The value of kmgpu's switch ``name`` in this process's environment, or its default.

    Args:
        name: a key of ``SWITCHES``.

    Returns:
        The variable's text, or the switch's default (None: unset).

    Raises:
        KeyError: ``name`` is not one of kmgpu's switches (add it to ``SWITCHES``).
    """
    return os.environ.get(name, SWITCHES[name].default)


def enabled(name):
    """Whether a switch that is on unless "0" (default "1") is on."""
    return setting(name) != "0"


def collective_timeout():
    """``KMGPU_COLLECTIVE_TIMEOUT`` as a ``datetime.timedelta``.

    Raises:
        ValueError: the variable is not a positive number of seconds.
    """
    import datetime

    text = setting("KMGPU_COLLECTIVE_TIMEOUT")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"KMGPU_COLLECTIVE_TIMEOUT={text!r}: set it to a number of seconds "
                         "greater than 0, or unset it (default 600).")
    return datetime.timedelta(seconds=seconds)


def simulated_count():
    """The number of simulated devices asked for, or 0."""
    try:
        return max(0, int(setting(SIMULATE_ENV) or "0"))
    except ValueError:
        return 0


DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Job:
    """Where this process sits in a multi-process job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" (also kmgpu launch) or "slurm"


def job(environ=None):
    """This process's place in a multi-process job, from the environment, or None.

    torchrun and ``kmgpu launch`` set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; SLURM's ``srun`` sets
    ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``.

    Returns:
        A ``Job``, or None when this process is not part of one.
    """
    env = os.environ if environ is None else environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        world = int(env["WORLD_SIZE"])
        return Job(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                   int(env.get("LOCAL_WORLD_SIZE", world)), env["MASTER_ADDR"],
                   int(env["MASTER_PORT"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        world = int(env["SLURM_STEP_NUM_TASKS"])
        return Job(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                   world // max(1, len(hosts)), env.get("MASTER_ADDR", hosts[0]),
                   int(env.get("MASTER_PORT", DEFAULT_PORT)), "slurm")
    return None


def process_index():
    """This process's index in a job of several processes, 0 for the main one.

    Read from the launcher's variables: ``RANK`` (torchrun, ``kmgpu launch`` on every
    backend), ``SLURM_PROCID`` (``srun``), else ``TF_CONFIG``'s task. 0 in a single
    process, kmgpu's torch worker pool included (your script is one process there).
    Imports no backend.

    Returns:
        An int from 0 to ``process_count() - 1``.
    """
    return _place()[0]


def process_count():
    """The number of processes running your script: 1 outside a launcher.

    Returns:
        ``WORLD_SIZE`` (torchrun, ``kmgpu launch``), SLURM's task count, or the chief
        and workers of ``TF_CONFIG``; else 1.
    """
    return _place()[1]


def is_main_process():
    """True in the process that should act once for the job: print, log, write files.

    kmgpu's own printing and saving (``verbose``, ``ModelCheckpoint``, ``parallel.save``)
    already happen there only; use this for your own code.
    """
    return _place()[0] == 0


def main_process_only(function):
    """Decorator: ``function`` runs in the main process only; elsewhere it returns None.

    Args:
        function: any callable (a logger's set-up, a print, a file write).

    Returns:
        The wrapped callable.
    """
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if is_main_process():
            return function(*args, **kwargs)
        return None

    return wrapper


def _place(environ=None):
    """(index, count) of this process: the launcher's variables, else TF_CONFIG."""
    env = os.environ if environ is None else environ
    j = job(env)
    if j is not None:
        return j.rank, j.world
    try:
        config = json.loads(env.get("TF_CONFIG") or "{}")
        cluster, task = config.get("cluster", {}), config.get("task", {})
        chiefs, workers = len(cluster.get("chief", [])), len(cluster.get("worker", []))
        if task.get("type") in ("chief", "worker") and chiefs + workers > 1:
            first = 0 if task["type"] == "chief" else chiefs  # the chief is the main one
            return first + int(task.get("index", 0)), chiefs + workers
    except (ValueError, TypeError, AttributeError):
        pass
    return 0, 1


def expand_hostlist(text):
    """SLURM's compact host list ("a,b[01-03,07]") -> ["a", "b01", "b02", "b03", "b07"]."""
    hosts, depth, item = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if item:
                hosts.extend(_expand_one(item))
            item = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        item += ch
    return hosts


def _expand_one(item):
    if "[" not in item:
        return [item]
    prefix, rest = item.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            out.extend(prefix + str(i).zfill(len(lo)) + s for s in _expand_one(suffix))
    return out


def for_this_process(call):
    """A fit/evaluate/predict call as this process runs it in a multi-process job.

    Process 0 keeps everything. The others print nothing (verbose=0), write nothing
    (``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``) and run ``BackupAndRestore``
    for restoring only (process 0 writes the backup). Callbacks that steer training
    (EarlyStopping, LR schedules) run everywhere: their metrics are global, so every
    process takes the same decision.

    The writers stay in every process's list, each in a ``process_zero_writer`` wrapper
    (on process 0 it runs them, elsewhere only a backup's restore): every process sees
    the same callbacks, so an engine whose state is spread over the processes can
    gather it for them in every process at the same step (``writers``).
    """
    j = job()
    if j is None or j.world == 1:
        return call
    if j.rank != 0:
        call = dict(call, verbose=0)
    if call.get("callbacks"):
        call["callbacks"] = [_process_zero_writer(cb) if _is_writer(cb) else cb
                             for cb in call["callbacks"]]
    return call


def writers(callbacks):
    """The callbacks ``for_this_process`` wrapped as writers, in order (each wrapper's
    ``writer`` is the user's callback, its ``writes_from`` the model its writes read, or
    None: the one Keras's fit sets)."""
    return [cb for cb in callbacks or () if hasattr(cb, "writer")]


def _is_writer(cb):
    import keras

    return isinstance(cb, (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
                           keras.callbacks.TensorBoard, keras.callbacks.BackupAndRestore))


def _process_zero_writer(writer):
    """``writer`` as process 0 runs it (every hook), and as the others do: nothing, or
    for a ``BackupAndRestore`` the restore at the start of training only. The user's
    callback is left as it is; ``writes_from`` (set by an engine) is the model its
    hooks see after the start of training."""
    import keras

    restore = isinstance(writer, keras.callbacks.BackupAndRestore)
    here = process_index() == 0

    class ProcessZeroWriter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.writer, self.writes_from = writer, None

        def set_model(self, model):
            super().set_model(model)
            writer.set_model(model)

        def set_params(self, params):
            super().set_params(params)
            writer.set_params(params)

        def on_train_begin(self, logs=None):
            if here or restore:  # a backup is restored into the model fit trains
                writer.set_model(self.model)
                writer.on_train_begin(logs)
            if self.writes_from is not None:
                writer.set_model(self.writes_from)

    def relay(name):
        def hook(self, *args, **kwargs):
            if here:
                getattr(writer, name)(*args, **kwargs)
        hook.__name__ = name
        return hook

    # only the hooks the writer has: Keras's fit skips a batch hook nobody implements
    base = keras.callbacks.Callback
    for name in ("on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
                 "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin",
                 "on_test_batch_end", "on_predict_begin", "on_predict_end",
                 "on_predict_batch_begin", "on_predict_batch_end"):
        if getattr(type(writer), name) is not getattr(base, name):
            setattr(ProcessZeroWriter, name, relay(name))
    return ProcessZeroWriter()


def tf_config(hosts, per_node, rank, master_port):
    """TF_CONFIG for worker ``rank``: worker k listens on its host, port master_port+1+k."""
    workers = [f"{h}:{master_port + 1 + r * per_node + i}"
               for r, h in enumerate(hosts) for i in range(per_node)]
    return json.dumps({"cluster": {"worker": workers},
                       "task": {"type": "worker", "index": rank}})

"""Torch worker pool: a dead worker or a dead parent costs an error, never a hang
or an orphan; worker traffic stays on loopback; temporary files are private and removed;
models reach the workers through Keras's safe mode.

(test_torch_engine.py covers a worker killed mid-fit, Ctrl-C and repeated calls.)
"""

import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import pytest

import kmgpu
from tests.helpers import alive, data, few_steps, mlp, rel_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _entries(pid):
    prefix = f"kmgpu-{pid}-"
    return sorted(os.path.join(root, name) for root in {"/dev/shm", tempfile.gettempdir()}
                  if os.path.isdir(root) for name in os.listdir(root) if name.startswith(prefix))


def _parallel(gpus=2, optimizer="sgd"):
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=gpus)
    return model, parallel


def _fit(parallel, x, y, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallel.fit(x, y, **dict(dict(batch_size=32, verbose=0, shuffle=False), **kwargs))


# -- a dead worker, a dead parent -----------------------------------------------------
def test_rank_0_killed_during_fit_errors_fast_and_leaves_no_process():
    """Rank 0 hosts the rendezvous store and talks to this process; when it dies the
    other ranks block in a collective. The call still ends, with the reason."""
    x, y = data("mlp", 640)
    model, parallel = _parallel()
    _fit(parallel, x[:32], y[:32])  # workers up
    pids = parallel._engine.worker_pids()
    killed = []

    def kill():
        killed.append(time.monotonic())
        os.kill(pids[0], signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) was killed by signal SIGKILL"):
        _fit(parallel, x, y, epochs=1000)
    seconds = time.monotonic() - killed[0]
    print(f"\nworker killed -> error in {seconds:.2f} s")
    assert seconds < 30
    assert not any(alive(pid) for pid in pids)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert len(_entries(os.getpid())) <= 1  # the call's data directory is gone


def test_a_worker_that_died_between_calls_is_replaced():
    x, y = data("mlp", 64)
    model, parallel = _parallel()
    _fit(parallel, x, y)
    pids = parallel._engine.worker_pids()
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    # until it can be reaped (/proc shows "Z" while its other threads still exit)
    while parallel._engine.launcher.pool.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    steps = int(model.optimizer.iterations.numpy())
    _fit(parallel, x, y)  # a fresh pool; the old one's survivors are stopped
    assert int(model.optimizer.iterations.numpy()) == steps + 2
    assert set(parallel._engine.worker_pids()).isdisjoint(pids)
    assert not any(alive(pid) for pid in pids)


_PARENT = """
import os, signal, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {root!r})
import kmgpu
kmgpu.simulate_devices(2)
from tests.helpers import data, mlp, without_other_backends
without_other_backends()
x, y = data("mlp", 64)
model = mlp()
model.compile(optimizer="sgd", loss="mse")
parallel = kmgpu.parallelize(model)
parallel.fit(x, y, batch_size=16, verbose=0)
print("PIDS", *parallel._engine.worker_pids(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close(): as when a kernel is killed
"""


def test_a_killed_parent_leaves_no_worker_and_no_file():
    env = dict(os.environ, KERAS_BACKEND="torch")
    env.pop(kmgpu.environment.SIMULATE_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", _PARENT.format(root=ROOT)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while (any(alive(p) for p in pids) or _entries(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "orphaned workers"
    assert _entries(proc.pid) == [], "files left in /dev/shm"


def test_leftovers_of_a_dead_process_are_swept():
    from kmgpu.engines.torch import transport

    dead = subprocess.Popen(["true"])
    dead.wait()
    path = tempfile.mkdtemp(prefix=f"kmgpu-{dead.pid}-", dir="/dev/shm")
    open(os.path.join(path, "state"), "wb").close()
    alive = tempfile.mkdtemp(prefix=f"kmgpu-{os.getppid()}-", dir="/dev/shm")
    try:
        transport.remove_leftovers()
        assert not os.path.exists(path)
        assert os.path.exists(alive)  # a live process's files stay
    finally:
        os.rmdir(alive)


# -- security -------------------------------------------------------------------------
def _socket_inodes(pid):
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _tcp_local_addresses():
    """inode -> local IP of every TCP socket in this network namespace."""
    out = {}
    for name, width in (("tcp", 8), ("tcp6", 32)):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            hex_ip = fields[1].split(":")[0]
            raw = bytes.fromhex(hex_ip)
            if width == 8:
                ip = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                ip = ":".join(words[i:i + 2].hex() for i in range(0, 16, 2))
            out[int(fields[9])] = ip
    return out


def _is_loopback(ip):
    return (ip.startswith("127.") or ip == "0000:0000:0000:0000:0000:0000:0000:0001"
            or ip.startswith("0000:0000:0000:0000:0000:ffff:7f"))


def test_worker_traffic_stays_on_loopback(monkeypatch):
    from kmgpu.engines.torch.launch import launchers

    launchers.close_pools()
    # an interface meant for multi-host jobs must not pull a one-host pool off loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    x, y = data("mlp", 64)
    model, parallel = _parallel(gpus=3)
    _fit(parallel, x, y)
    addresses = _tcp_local_addresses()
    seen = {}
    for pid in parallel._engine.worker_pids():
        for inode in _socket_inodes(pid):
            if inode in addresses:
                seen[(pid, inode)] = addresses[inode]
    assert len(seen) >= 3, seen  # the store and the gloo pairs
    assert all(_is_loopback(ip) for ip in seen.values()), seen
    parallel.close()


def test_temporary_files_are_private_and_removed_on_success_and_failure():
    import keras

    x, y = data("mlp", 64)
    model, parallel = _parallel()
    seen = []

    def look(epoch, logs):  # runs in this process while the workers are in the call
        for path in _entries(os.getpid()):
            for root, _, files in os.walk(path):
                seen.append(("dir", stat.S_IMODE(os.stat(root).st_mode)))
                seen.extend(("file", stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode))
                            for f in files)

    _fit(parallel, x, y, callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=look)])
    dirs = [mode for kind, mode in seen if kind == "dir"]
    files = [mode for kind, mode in seen if kind == "file"]
    assert len(dirs) >= 2 and len(files) >= 3, seen  # the call's data (x, y) + the state
    assert set(dirs) == {0o700} and set(files) == {0o600}, seen
    assert len(_entries(os.getpid())) == 1  # only the pool's state directory stays

    def fail(epoch, logs):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        _fit(parallel, x, y, callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=fail)])
    assert len(_entries(os.getpid())) == 1  # the failed call's data went too
    parallel.close()
    assert _entries(os.getpid()) == []


def test_models_reach_the_workers_in_safe_mode():
    """The workers rebuild the model from its config with Keras's safe mode on: a Lambda
    layer's Python lambda reaches them as the user's own function (pickled by value over
    the pipe), not as bytecode loaded from a config, so it trains as on one device; and
    nothing in kmgpu turns safe mode off."""
    import keras

    def make():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Lambda(lambda t: t * 2),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = data("mlp", 16)
    reference, model = make(), make()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=2)
    with few_steps():
        parallel.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert rel_diff(reference.get_weights(), model.get_weights()) <= 1e-5
    source = ""
    for root, _, files in os.walk(os.path.join(ROOT, "kmgpu")):
        source += "".join(open(os.path.join(root, f)).read() for f in files if f.endswith(".py"))
    assert "safe_mode=False" not in source and "enable_unsafe_deserialization" not in source
    # files are read as raw arrays, never unpickled (pickles only travel over the pipes
    # between this process and its own workers)
    assert "allow_pickle=True" not in source and "pickle.load(" not in source


def test_what_cannot_travel_to_spawned_workers_is_named():
    """A loss holding a lock cannot be pickled for spawned workers (CUDA): the refusal
    names it, before any work; forked workers (CPU) inherit it instead."""
    import threading

    import keras

    from kmgpu.engines.torch import replicas

    class Locked(keras.losses.MeanSquaredError):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lock = threading.Lock()

    model = mlp()
    model.compile(optimizer="sgd", loss=Locked())
    spec, inherit = replicas.model_spec(model)
    assert inherit and spec.objects is None
    from kmgpu.engines.torch import transport

    names = replicas.unpicklable(transport.INHERITED["objects"])
    assert names == ["compile loss (Locked)"]

"""Long sessions: 50 consecutive fit / evaluate / predict calls in one process
leave no extra process, thread, file descriptor, socket (port) or shared-memory / temp
file, and resident memory (this process plus its workers) grows by less than 10% after
a warm-up. Tiny model and data: it measures leaks, not speed."""

import gc
import os
import tempfile
import threading
import warnings

import numpy as np

import kmgpu
from tests.helpers import children, data, mlp

CALLS = 50


def _rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fds(pid):
    """(number of open descriptors, number of them that are sockets)."""
    fds = socks = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        fds += 1
        socks += target.startswith("socket:")
    return fds, socks


def _temp_entries(pids):
    prefixes = tuple(f"kmgpu-{p}-" for p in pids)
    return sorted(name for root in {"/dev/shm", tempfile.gettempdir()} if os.path.isdir(root)
                  for name in os.listdir(root) if name.startswith(prefixes))


def resources():
    me = os.getpid()
    kids = children(me)
    pids = [me] + kids
    fds = [_fds(p) for p in pids]
    return {
        "processes": kids,
        # not TensorFlow's drops of a call's iterators: a thread each, which ends by itself
        # (kmgpu/engines/tensorflow/data_fixes.py, _release)
        "threads": sum(t.name != "kmgpu-iterator-release" for t in threading.enumerate()),
        "fds": sum(f for f, _ in fds),
        "sockets": sum(s for _, s in fds),
        "temp files": _temp_entries(pids),
        "rss": sum(_rss(p) for p in pids),
    }


def test_fifty_calls_leak_nothing():
    x, y = data("mlp", 32)
    model = mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=2)

        def call(i):  # fit, evaluate, predict, evaluate, predict, fit, ...
            if i % 5 == 0:
                parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)
            elif i % 2 == 1:
                parallel.evaluate(x, y, batch_size=16, verbose=0)
            else:
                assert parallel.predict(x, batch_size=16, verbose=0).shape == (32, 1)

        for i in range(3):  # warm-up: compiled functions, worker pool, allocator pools
            call(i)
        gc.collect()
        before = resources()
        for i in range(CALLS):
            call(i)
        gc.collect()
        after = resources()
    growth = after["rss"] / before["rss"] - 1
    print(f"\nsoak ({CALLS} calls): rss {before['rss'] / 2**20:.0f} -> "
          f"{after['rss'] / 2**20:.0f} MiB ({100 * growth:+.1f}%), processes "
          f"{len(before['processes'])} -> {len(after['processes'])}, fds {before['fds']} -> "
          f"{after['fds']}, sockets {before['sockets']} -> {after['sockets']}, temp files "
          f"{len(before['temp files'])} -> {len(after['temp files'])}")
    for key in ("processes", "threads", "fds", "sockets", "temp files"):
        assert after[key] == before[key], key
    assert growth < 0.10
    assert int(model.optimizer.iterations.numpy()) == 2 * (1 + len(range(0, CALLS, 5)))
    assert all(np.isfinite(w).all() for w in model.get_weights())

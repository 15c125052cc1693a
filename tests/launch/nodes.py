"""Start ``kmgpu launch`` as N "hosts" on 127.0.0.1 and read what train.py wrote.

Used by tests/<backend>/test_launch.py; every test runs tests/launch/train.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.helpers import alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "launch", "train.py")


def free_port(span=6):
    """A port p with p .. p+span free (JAX uses p+1, TensorFlow workers p+1 ...)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and all(_free(port + i) for i in range(1, span + 1)):
            return port
    raise RuntimeError("no free port range on 127.0.0.1")


def _free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start(backend, out, nnodes=2, nproc=1, script=SCRIPT, options=(), **env):
    """One ``kmgpu launch`` of ``script`` per host, each in its own session; returns the
    Popens. ``options``: more ``kmgpu launch`` options."""
    port = free_port()
    e = dict(os.environ, KERAS_BACKEND=backend, KMGPU_TEST_OUT=str(out), PYTHONPATH=ROOT,
             GLOO_SOCKET_IFNAME="lo", **env)
    for key in ("KMGPU_SIMULATE_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS", "RANK", "WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        e.pop(key, None)  # each process: one CPU device, no job of ours inherited
    e["JAX_PLATFORMS"] = "cpu"
    nodes = []
    for r in range(nnodes):
        cmd = [sys.executable, "-m", "kmgpu", "launch", "--nnodes", str(nnodes),
               "--node-rank", str(r), "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), *options, script]
        log = open(os.path.join(out, f"node{r}.log"), "w")
        nodes.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return nodes


def wait(nodes, timeout):
    """Exit codes of all nodes (None for one still running at the deadline)."""
    deadline = time.time() + timeout
    for p in nodes:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in nodes]


def results(out, prefix="rank"):
    """What each process wrote to ``<prefix><r>.json`` in ``out``, in file name order."""
    return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))
            if f.startswith(prefix) and f.endswith(".json")]


def logs(out):
    return "\n".join(open(os.path.join(out, f)).read()[-3000:]
                     for f in sorted(os.listdir(out)) if f.endswith(".log"))


def pids(out):
    found = {}
    for f in os.listdir(out):
        if f.startswith("pid"):
            text = open(os.path.join(out, f)).read()
            if text:
                found[int(f[3:])] = int(text)
    return found


def cleanup(nodes, out):
    """Stop whatever this test started: the launchers' sessions and the workers."""
    for p in nodes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    for pid in pids(out).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def parity_then_kill(backend, out, nproc=1, tol=1e-5, timeout=150, script=SCRIPT):
    """2 hosts x ``nproc`` processes train 2 epochs and compare with one process; then
    the last process is killed mid-run and every host must stop, non-zero, within 60 s
    (torch: a peer silent for 40 s, ``KMGPU_COLLECTIVE_TIMEOUT``, fails the waiting ones).
    ``script``: train.py, or a script that runs checks of its own first and then
    train.py's ``main`` (its results: ``results(out, prefix)``).

    Returns:
        {"results": per-rank dicts, "seconds_to_fail": after the kill, "codes": exit codes}
    """
    world = 2 * nproc
    # the bound the job sets on waiting for a silent peer (torch's collectives)
    nodes = start(backend, out, nproc=nproc, script=script, KMGPU_TEST_KILL="1",
                  KMGPU_COLLECTIVE_TIMEOUT="40")
    try:
        t0 = time.time()
        while len(pids(out)) < world:
            codes = [p.poll() for p in nodes]
            assert time.time() - t0 < timeout and None in codes, (codes, logs(out))
            time.sleep(0.2)
        found = results(out)
        assert len(found) == world, logs(out)
        for r in found:
            assert r["replicas"] == world, r
            assert r["rel_diff"] <= tol, r
            assert r["pred_rows"] == 64 and r["pred_err"] < 1e-5, r
            for a, b in zip(r["loss"], r["ref_loss"]):
                assert abs(a - b) <= tol * abs(b), r
        writes = sorted(r["checkpoint_writes"] for r in found)
        assert writes == [[]] * (world - 1) + [[0, 1]], writes  # ModelCheckpoint: process 0
        assert [r["rank"] for r in found if r["checkpoint_writes"]] == [0]
        helpers = sorted(r["helpers"] for r in found)  # kmgpu.process_index, _count, is_main
        assert helpers == [[i, world, i == 0] for i in range(world)], helpers
        assert os.path.exists(os.path.join(out, "ckpt.weights.h5"))
        assert os.path.exists(os.path.join(out, "model.keras"))  # parallel.save: process 0
        victims = pids(out)
        time.sleep(1.0)  # well into the next fit
        os.kill(victims[world - 1], signal.SIGKILL)
        killed = time.time()
        codes = wait(nodes, 60)
        seconds = time.time() - killed
        assert all(c not in (None, 0) for c in codes), (codes, logs(out))
        deadline = time.time() + 10  # workers end with their launcher
        while any(alive(p) for p in victims.values()) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in victims.values()), victims
        return {"results": found, "seconds_to_fail": seconds, "codes": codes}
    finally:
        cleanup(nodes, out)

"""The largest model that trains here, measured: a Dense stack grown until a fit no longer
fits the host memory you allow it.

    KERAS_BACKEND=<jax|torch> python benchmarks/largest_model.py [--devices 4]
        [--shards weights none] [--limit-gib 16] [--width 4096]

Each try is a fresh process (the "job") that builds a stack of ``depth`` Dense layers of
``width`` units under ``with keras.device("cpu"):``, parallelizes it over N simulated
devices with ``shard`` (``none``: unsharded), compiles it with Adam in float32 and fits one
epoch of two steps (batch 8). While it runs, this process samples its host memory as
``host_memory.py`` does (every process's PSS plus kmgpu's files in /dev/shm) and stops the
job once the sum passes ``--limit-gib``: a try passes when the fit ends within the limit.
The depth doubles from ``--start`` (1) until a try fails, then is bisected. Each row gives
the largest depth that passed: its parameters, the peak host memory of its fit and that peak per
parameter (start-up included), and the smallest depth that did not.

Prints a Markdown table; no figure here is asserted by a test.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_memory import Sampler, parallelized  # noqa: E402

FEATURES = 16
BATCH = 8


def job(n, shard, depth, width):
    """Runs in the measured process: one fit of two steps, its start and end said."""
    import numpy as np

    import kmgpu

    kmgpu.simulate_devices(n)
    import keras

    keras.utils.set_random_seed(0)
    with keras.device("cpu"):
        model = keras.Sequential([keras.Input((FEATURES,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(depth)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(2 * BATCH, width)).astype("float32")
    parallel = parallelized(model, n, shard)
    print("FIT-START", flush=True)
    parallel.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    print("FIT-END", flush=True)


def attempt(backend, n, shard, depth, width, limit):
    """(passed, params, peak bytes) of one try; the job is stopped past ``limit`` bytes."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--job", str(n), shard, str(depth),
         str(width)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
        start_new_session=True)
    sampler = Sampler(proc.pid)
    over = []

    def watch():
        while proc.poll() is None:
            if sampler.last and sampler.last[0] > limit:
                over.append(sampler.last[0])
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    params, ended = None, False
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            params = json.loads(line).get("params", params)
        elif line == "FIT-START":
            sampler.mark("fit")
        elif line == "FIT-END":
            ended = True
            sampler.mark("after")
    proc.wait()
    watcher.join()
    sampler.close()
    peak = max(row[0] for row in sampler.peak.values())
    return ended and not over and proc.returncode == 0, params, peak


def largest(backend, n, shard, width, limit, say, start=1):
    """(depth, params, peak) of the largest try that passed, and the smallest failed depth;
    the depth doubles from ``start``."""
    best, failed, depth = None, None, start
    while failed is None:
        ok, params, peak = attempt(backend, n, shard, depth, width, limit)
        say(depth, ok, params, peak)
        if ok:
            best, depth = (depth, params, peak), depth * 2
        else:
            failed = depth
    lo = best[0] if best else 0
    if best is None and start > 1:  # the first try was over: look below it
        return largest(backend, n, shard, width, limit, say, 1)
    while failed - lo > 1:
        mid = (lo + failed) // 2
        ok, params, peak = attempt(backend, n, shard, mid, width, limit)
        say(mid, ok, params, peak)
        if ok:
            best, lo = (mid, params, peak), mid
        else:
            failed = mid
    return best, failed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--shards", nargs="+", default=["weights", "none"])
    p.add_argument("--limit-gib", type=float, default=16.0)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--start", type=int, default=1, help="the first depth tried")
    a = p.parse_args()
    if a.job:
        n, shard, depth, width = (int(v) if v.isdigit() else v for v in a.job)
        return job(n, shard, depth, width)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    gib = float(1 << 30)
    limit = a.limit_gib * gib
    print(f"backend {backend}; N = {a.devices}; Dense({a.width}) stack, Adam float32; "
          f"host memory limit {a.limit_gib:g} GiB (every process's PSS + /dev/shm)", flush=True)
    rows = []
    for shard in a.shards:
        def say(depth, ok, params, peak):
            print(f"  shard={shard} depth={depth}: {'fits' if ok else 'over'} "
                  f"({(params or 0) / 1e6:,.0f} M parameters, peak {peak / gib:.2f} GiB)",
                  flush=True)

        best, failed = largest(backend, a.devices, shard, a.width, limit, say, a.start)
        if best is None:
            rows.append(f"| {shard} | none fits | - | - | - | 1 |")
            continue
        depth, params, peak = best
        rows.append(f"| {shard} | {depth} | {params / 1e6:,.0f} M | {peak / gib:.2f} | "
                    f"{peak / params:.1f} | {failed} |")
    print(f"\n| shard | largest depth | parameters | peak GiB | peak B/param (start-up "
          f"included) | first depth over {a.limit_gib:g} GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()

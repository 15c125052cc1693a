"""Host memory of a ``fit``: the bytes per parameter the host pays, measured.

``KERAS_BACKEND=<jax|torch> python benchmarks/host_memory.py [--devices 2 4 8]
[--shards weights none] [--depths 3 15] [--rounds 1] [--remat full]
[--checkpoint sharded|keras]`` on CPU with simulated devices (``--remat``: the stack built
under ``keras.RematScope``; ``--checkpoint``: the fit saves at each epoch end with
``kmgpu.ShardedCheckpoint``, or with Keras's ``ModelCheckpoint`` and the optimizer, into a
directory on disk, whose size is said).

Each row is a fresh process (the "job") that builds a Dense stack (width 1024, ``depth``
layers: 2.1 M parameters at depth 3, 14.7 M at 15), parallelizes it over N simulated
devices with ``shard`` (``none``: unsharded), compiles it with Adam in float32 and fits
it 2 epochs. While the job runs, this process samples the host memory every 50 ms:

- every process of the job (the driver and its children: torch's worker ranks) by its
  proportional set size, ``Pss`` of ``/proc/<pid>/smaps_rollup`` (a page shared by k
  processes counts 1/k in each, so the sum counts it once);
- plus the bytes of the job's files in ``/dev/shm`` and the temp dir (kmgpu's
  ``kmgpu-<pid>-*`` entries), which stay in memory (tmpfs) whether mapped or not.

The figure is the peak of that sum while ``fit`` runs (the job says when it starts and
ends), and ``at fit`` the sum just before it starts (the model built, the imports done).
A page of a ``/dev/shm`` file that a process maps is counted twice (its PSS and the file);
the ``shm mapped`` column is the mapped part of the PSS (``Pss_Shmem``) at the peak, so the
peak less it counts every page once.

The slope over two depths (the start-up, the imports, the data, cancel out) is the
figure: host bytes per parameter, ``(peak(depth b) - peak(depth a)) / (P_b - P_a)``.
The ideal under ``shard="weights"`` is 16 / N per device x N devices = 16 (the sharded
weights, gradients and Adam's two moments) plus 4 (your model's own weights).

``after fit``: the same slope of the peak in the 0.3 s after ``fit`` returns (what stays).

What a CPU run counts that a GPU host would not: each simulated device's memory is host
memory here, so the sharded state (16 / N per device) and what a step holds on each device
(JAX: the weights XLA gathers and the gradients it sums on each simulated device within
a step; torch: each rank's layers gathered ahead) are in the figure; on GPUs
they are device memory. And the C library's allocator keeps freed memory for reuse (glibc
raises its mmap threshold after the first large free), which a process's PSS counts.

Prints a table per backend; no figure here is asserted by a test.
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH = 1024
FEATURES = 16
ROWS = 512
BATCH = 64


# -- the job --------------------------------------------------------------------------
def job(n, shard, depth):
    """Runs in the measured process: one fit, its start and end said on stdout."""
    import numpy as np

    import kmgpu

    kmgpu.simulate_devices(n)
    import keras

    keras.utils.set_random_seed(0)
    remat = os.environ.get("HOST_MEMORY_REMAT")  # --remat: the layers made under RematScope
    with keras.RematScope(mode=remat) if remat else contextlib.nullcontext():
        layers = [keras.Input((FEATURES,))]
        layers += [keras.layers.Dense(WIDTH, activation="relu") for _ in range(depth - 1)]
        model = keras.Sequential(layers + [keras.layers.Dense(WIDTH)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, WIDTH)).astype("float32")
    parallel = parallelized(model, n, shard)
    saves = os.environ.get("HOST_MEMORY_CHECKPOINT")  # --checkpoint
    where = tempfile.mkdtemp(prefix="host-memory-", dir=os.getcwd()) if saves else None
    callbacks = []
    if saves == "sharded":
        callbacks = [kmgpu.ShardedCheckpoint(where)]
    elif saves == "keras":
        callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(where, "model.keras"))]
    print("FIT-START", flush=True)
    start = time.perf_counter()
    parallel.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    print(json.dumps({"fit_s": time.perf_counter() - start}), flush=True)
    if where is not None:
        size = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(where)
                   for f in fs)
        shutil.rmtree(where)
        print(json.dumps({"checkpoint_bytes": size}), flush=True)
    print("FIT-END", flush=True)
    # give the sampler one more look at the state after the fit
    time.sleep(0.3)
    print("AFTER", flush=True)


def parallelized(model, n, shard):
    """``model`` over ``n`` simulated devices with ``shard`` (``none``: unsharded), compiled
    with Adam and MSE; its parameter count said on stdout, as the sampler reads it."""
    import warnings

    import kmgpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=n, shard=None if shard == "none" else shard)
    parallel.compile(optimizer="adam", loss="mse")
    print(json.dumps({"params": int(model.count_params())}), flush=True)
    return parallel


# -- the sampler ----------------------------------------------------------------------
def _children(pid):
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid):
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _rollup(pid):
    """(Pss, Pss_Shmem) of ``pid`` in bytes (0, 0 when it is gone)."""
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Pss_Shmem:"):
                    shmem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, shmem


def _files_bytes(pids):
    """Bytes in memory of the ``kmgpu-<pid>-*`` entries of ``pids`` in /dev/shm and the
    temp dir (tmpfs: allocated blocks)."""
    total = 0
    prefixes = tuple(f"kmgpu-{p}-" for p in pids)
    for root in {"/dev/shm", tempfile.gettempdir()}:
        try:
            names = [n for n in os.listdir(root) if n.startswith(prefixes)]
        except OSError:
            continue
        for name in names:
            for base, _, files in os.walk(os.path.join(root, name)):
                for fn in files:
                    try:
                        total += os.lstat(os.path.join(base, fn)).st_blocks * 512
                    except OSError:
                        pass
    return total


class Sampler:
    def __init__(self, pid):
        self.pid = pid
        self.known = {pid}
        self.phase = "start"
        self.peak = {}  # phase -> (total, pss, shm files, pss_shmem, processes)
        self.last = None
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def sample(self):
        pids = _tree(self.pid)
        self.known.update(pids)
        rolls = [_rollup(p) for p in pids]
        pss = sum(r[0] for r in rolls)
        shmem = sum(r[1] for r in rolls)
        files = _files_bytes(self.known)
        row = (pss + files, pss, files, shmem, len(pids), [r[0] for r in rolls])
        self.last = row
        best = self.peak.get(self.phase)
        if best is None or row[0] > best[0]:
            self.peak[self.phase] = row
        return row

    def _loop(self):
        while not self.stop:
            self.sample()
            time.sleep(0.05)

    def mark(self, phase):
        self.sample()
        if phase == "fit":
            self.at_fit = self.last
        self.phase = phase
        self.sample()

    def close(self):
        self.stop = True
        self.thread.join()


def measure(backend, n, shard, depth):
    env = dict(os.environ, KERAS_BACKEND=backend)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--job", str(n), shard, str(depth)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    sampler = Sampler(proc.pid)
    params = fit_s = None
    saved = 0
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            said = json.loads(line)
            params = said.get("params", params)
            fit_s = said.get("fit_s", fit_s)
            saved = said.get("checkpoint_bytes", saved)
        elif line == "FIT-START":
            sampler.mark("fit")
        elif line == "FIT-END":
            sampler.mark("after")
        elif line == "AFTER":
            sampler.mark("done")
    proc.wait()
    sampler.close()
    if proc.returncode or params is None:
        raise RuntimeError(f"the job {backend} N={n} {shard} depth={depth} failed")
    return {"params": params, "fit_s": fit_s, "at_fit": sampler.at_fit, "fit": sampler.peak["fit"],
            "after": sampler.peak.get("after", sampler.peak["fit"]), "checkpoint": saved}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, nargs="+", default=[4])
    p.add_argument("--shards", nargs="+", default=["weights", "none"])
    p.add_argument("--depths", type=int, nargs=2, default=[3, 15])
    p.add_argument("--rounds", type=int, default=1, help="runs of each row; the median")
    p.add_argument("--remat", choices=["full", "activations"],
                   help="build the stack under keras.RematScope(mode=REMAT)")
    p.add_argument("--checkpoint", choices=["sharded", "keras"],
                   help="save at each epoch end: kmgpu.ShardedCheckpoint, or Keras's "
                        "ModelCheckpoint (a .keras file with the optimizer)")
    a = p.parse_args()
    if a.remat:  # the jobs read it
        os.environ["HOST_MEMORY_REMAT"] = a.remat
    if a.checkpoint:
        os.environ["HOST_MEMORY_CHECKPOINT"] = a.checkpoint
    if a.job:
        n, shard, depth = a.job
        return job(int(n), shard, int(depth))
    backend = os.environ.get("KERAS_BACKEND", "jax")
    mib = 1 << 20
    print(f"backend {backend}; Dense stack width {WIDTH}, depths {a.depths}, Adam float32; "
          f"peak of every process's PSS + the job's /dev/shm files over fit", flush=True)
    head = ("| N | shard | peak in fit (MiB) | of it /dev/shm files | B/param (peak) | "
            "B/param (each page once) | B/param (after fit) | fit (s) |")
    rows = []
    for n in a.devices:
        for shard in a.shards:
            runs = {}
            for depth in a.depths:
                got = []
                for _ in range(a.rounds):
                    got.append(measure(backend, n, shard, depth))
                got.sort(key=lambda r: r["fit"][0])
                runs[depth] = got[len(got) // 2]
                r = runs[depth]
                print(f"  N={n} shard={shard} depth={depth}: params {r['params']:,}, "
                      f"at fit {r['at_fit'][0] / mib:.0f} MiB, peak {r['fit'][0] / mib:.0f} "
                      f"MiB (PSS {r['fit'][1] / mib:.0f}, files {r['fit'][2] / mib:.0f}, "
                      f"shm mapped {r['fit'][3] / mib:.0f}, {r['fit'][4]} processes: "
                      f"{' + '.join(f'{b / mib:.0f}' for b in r['fit'][5])}), after "
                      f"{r['after'][0] / mib:.0f} MiB; fit {r['fit_s']:.1f} s"
                      + (f"; checkpoint on disk {r['checkpoint'] / mib:.0f} MiB"
                         if r["checkpoint"] else ""), flush=True)
            lo, hi = (runs[d] for d in a.depths)
            dp = hi["params"] - lo["params"]

            def slope(key, i=0, minus=None):
                v = hi[key][i] - lo[key][i]
                if minus is not None:
                    v -= hi[key][minus] - lo[key][minus]
                return v / dp

            rows.append(f"| {n} | {shard} | {lo['fit'][0] / mib:.0f} / {hi['fit'][0] / mib:.0f} "
                        f"| {lo['fit'][2] / mib:.0f} / {hi['fit'][2] / mib:.0f} "
                        f"| {slope('fit'):.0f} | {slope('fit', 0, 3):.0f} "
                        f"| {slope('after'):.0f} | {lo['fit_s']:.1f} / {hi['fit_s']:.1f} |")
    print(f"\nparams {lo['params']:,} / {hi['params']:,}; each cell small / large model; "
          f"B/param: the slope between them\n")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()

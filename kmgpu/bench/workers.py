"""Worker processes of ``kmgpu bench``: which runs share one, their environment, starting
them (each in its own process group), reading their records, stopping them at the time
limit, and several at once (``--jobs``)."""

import json
import os
import subprocess
import sys
import tempfile
import time

from kmgpu.bench import paths, plan


def batches(mine, isolate, names, jobs=1):
    """The runs of one backend, grouped into worker processes: one per run, per workload,
    or per backend (split by workload over ``jobs`` processes)."""
    if isolate == "backend":
        groups = [[r for r in mine if (names + ["allreduce"]).index(r["workload"]) % jobs == j]
                  for j in range(jobs)] if jobs > 1 else [mine]
        return [g for g in groups if g]
    if isolate == "workload":  # the all-reduce sweep first: short, and the projection's input
        groups = [[r for r in mine if r["workload"] == w] for w in ["allreduce"] + names]
        return [g for g in groups if g]
    return [[r] for r in mine]


def merged(streams):
    """Records of several workers as they come (one: just its own, in this thread)."""
    if len(streams) == 1:
        yield from streams[0]
        return
    import queue
    import threading

    records, end = queue.Queue(), object()

    def pump(stream):
        try:
            for rec in stream:
                records.put(rec)
        finally:
            records.put(end)

    threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    running = len(threads)
    while running:
        rec = records.get()
        if rec is end:
            running -= 1
        else:
            yield rec


def environment(child_env, backend, quick_cpu=False):
    env = dict(child_env, KERAS_BACKEND=backend)
    if quick_cpu:  # XLA on a CPU: compile fast rather than well (a smoke test's programs)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                            " --xla_llvm_disable_expensive_passes=true").strip()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # JAX takes 75% of each GPU up front unless told not to; without that the memory
    # figures (nvidia-smi's) would say nothing. The same for every JAX run.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # The worker imports this very kmgpu, wherever it is installed.
    env["PYTHONPATH"] = paths.PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def visible(env, count, visible_gpu_indices):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if "CUDA_VISIBLE_DEVICES" in env:
            os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        return visible_gpu_indices(count)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _stop_group(proc):
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run(batch, spec, env, log, tmp, timeout, budget, by_budget=False):
    """Start one worker for ``batch`` (runs of one backend); yield its records."""
    spec = dict(spec, runs=[{k: r[k] for k in ("workload", "runner", "devices", "policy")}
                            | {"tier": r.get("tier", 0)} for r in batch])
    handle, spec_path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=tmp)
    with os.fdopen(handle, "w") as f:
        json.dump(spec, f)
    log.write(f"=== {batch[0]['backend']}: {json.dumps(spec['runs'])}\n")
    log.flush()
    # Its own process group: stopping it stops what it started (torch worker pool, DDP
    # ranks), which would otherwise hold the GPUs and the output pipe.
    proc = subprocess.Popen([sys.executable, "-m", "kmgpu.bench.worker", spec_path],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    seen, stopped = set(), []
    timer = None
    if timeout != float("inf"):
        import threading

        def stop():
            stopped.append(True)
            _stop_group(proc)

        timer = threading.Timer(max(timeout, 1.0), stop)
        timer.start()
    since = time.monotonic()
    try:
        for line in proc.stdout:
            if line.startswith("KMGPU-BENCH "):
                rec = json.loads(line[len("KMGPU-BENCH "):])
                if rec.get("kind") == "run":
                    rec["policy"] = rec.get("policy", "global")
                    seen.add(plan.key({**rec, "backend": batch[0]["backend"]}))
                    now = time.monotonic()
                    budget.record({**rec, "backend": batch[0]["backend"]}, now - since)
                    since = now
                yield rec
            else:
                log.write(line)
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
        if proc.poll() is None:  # this command is being stopped (Ctrl-C): its worker too
            _stop_group(proc)
    log.flush()
    for r in batch:
        if plan.key(r) not in seen:
            if stopped and by_budget:
                yield {"kind": "run", **r, "status": "skipped",
                       "reason": "stopped at the time budget (--budget)"}
                continue
            why = ("stopped after --timeout seconds" if stopped else
                   f"worker process ended (exit status {rc}) before this run finished")
            yield {"kind": "run", **r, "status": "error", "error": why}

"""The worker processes of ``kmgpu bench`` (each runs ``worker.py``), seen from the command:
their environment, starting them (each in its own process group), handing them runs and
reading their records, stopping them at the time limit."""

import json
import os
import subprocess
import sys
import tempfile
import time

from kmgpu.bench import paths, plan


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


class Worker:
    """One worker process of one backend (its own process group: stopping it stops what
    it started, the torch worker pool and DDP ranks, which would otherwise hold the GPUs
    and the output pipe). ``run`` hands it a unit's runs and yields their records; it
    stays for the next unit until ``close``."""

    def __init__(self, backend, spec, env, log, tmp):
        handle, path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=tmp)
        with os.fdopen(handle, "w") as f:
            json.dump(spec, f)
        self.backend, self.log = backend, log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kmgpu.bench.worker", path], cwd=tmp, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def run(self, batch, timeout, budget, by_budget=False):
        """Yield the records of ``batch`` (runs of this backend), stopping the process
        after ``timeout`` seconds; runs it did not finish get a record saying why."""
        runs = [{k: r[k] for k in ("workload", "runner", "devices", "policy")} for r in batch]
        self.log.write(f"=== {self.backend}: {json.dumps(runs)}\n")
        self.log.flush()
        seen, stopped, timer = set(), [], None
        if timeout != float("inf"):
            import threading

            def stop():
                stopped.append(True)
                _stop_group(self.proc)

            timer = threading.Timer(max(timeout, 1.0), stop)
            timer.start()
        since = logged = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps(runs) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if not line.startswith("KMGPU-BENCH "):
                    self.log.write(line)
                    continue
                rec = json.loads(line[len("KMGPU-BENCH "):])
                if rec.get("kind") == "done":
                    break
                now = time.monotonic()
                if rec.get("kind") == "env":  # where a unit's seconds go, for the log
                    parts = ", ".join(f"{k} {v} s" for k, v in rec.get("start_s", {}).items())
                    self.log.write(f"--- process ready after {now - since:.1f} s"
                                   + (f" ({parts})" if parts else "") + "\n")
                    logged = now  # the log's first run starts here, its budget at since
                if rec.get("kind") == "run":
                    rec["policy"] = rec.get("policy", "global")
                    rec["backend"] = self.backend
                    seen.add(plan.key(rec))
                    budget.record(rec, now - since)  # a new process's start included
                    self.log.write(f"--- {rec['runner']}: {now - logged:.1f} s, "
                                   f"{rec.get('wall_s') or 0:.1f} s of it in the run\n")
                    since = logged = now
                yield rec
        except (BrokenPipeError, OSError):
            pass  # the process is gone: its runs are reported below
        finally:
            if timer:
                timer.cancel()
        self.log.flush()
        for r in batch:
            if plan.key(r) not in seen:
                if stopped and by_budget:
                    yield {"kind": "run", **r, "status": "skipped",
                           "reason": "stopped at the time budget (--budget)"}
                    continue
                why = ("stopped after --timeout seconds" if stopped else
                       f"worker process ended (exit status {self.proc.poll()}) before "
                       "this run finished")
                yield {"kind": "run", **r, "status": "error", "error": why}

    def close(self):
        """End the process: stdin closed, it exits; stopped if it does not in time."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _stop_group(self.proc)
        if self.proc.poll() is None:
            _stop_group(self.proc)

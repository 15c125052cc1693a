"""One backend's benchmark runs, in one process (``KERAS_BACKEND`` is fixed per process).

    KERAS_BACKEND=jax python -m kmgpu.bench.worker SPEC.json

SPEC: {"quick": bool, "simulate": int (0: real devices), "weights_dir": folder for the
final weights, "max_devices": int, "epochs": int|null, "steps": int|null,
"jax_cache": folder|null}. The runs come on stdin, one JSON list of runs
[{"workload", "runner", "devices", "policy"}, ...] a line, until stdin closes: the command
hands out one unit at a time and decides on the next once this one is done.
Prints one line ``KMGPU-BENCH {json}`` for the environment, then one per run, as each
finishes, and ``{"kind": "done"}`` after each line's runs; everything else it prints is
log.
"""

import json
import os
import re
import statistics
import sys
import time
import traceback

TAG = "KMGPU-BENCH "


def emit(record):
    sys.stdout.write(TAG + json.dumps(record) + "\n")
    sys.stdout.flush()


def environment():
    import keras

    import kmgpu
    from kmgpu.bench import common

    backend = keras.config.backend()
    version = getattr(sys.modules.get(backend) or __import__(backend), "__version__", "?")
    info = {"kind": "env", "backend": backend, "keras": keras.__version__,
            "backend_version": version, "devices": kmgpu.devices(),
            "dtype_policy": keras.config.dtype_policy().name}
    try:
        if backend == "jax":
            import jax

            info["device_kinds"] = sorted({d.device_kind for d in jax.devices()})
        elif backend == "torch":
            import torch

            if torch.cuda.is_available():
                info["device_kinds"] = [torch.cuda.get_device_name(0)]
                info["cuda"] = torch.version.cuda
        if common.has_gpu():
            from kmgpu.callbacks import nvidia_gpus

            names = nvidia_gpus() or info.get("device_kinds") or [""]
            info["gpu_name"] = names[0]
    except Exception:
        pass
    return info


def measure(spec_run, spec, env):
    import numpy as np

    from kmgpu.bench import allreduce, common, flops, projection, runners, workloads

    runner, n = spec_run["runner"], spec_run["devices"]
    backend = env["backend"]
    started = time.perf_counter()
    if runner == "allreduce":
        result = allreduce.sweep(backend, n, common.has_gpu())
        points = result["points"]
        record = {"kind": "run", **spec_run, "status": "ok", "method": result["method"],
                  "points": points, "wall_s": time.perf_counter() - started,
                  "busbw_points": [projection.bus_bandwidth(m, t, n) for m, t in points]}
        try:
            record["alpha_s"], record["busbw"] = projection.fit_alpha_beta(points, n)
        except ValueError as e:
            record["fit_error"] = str(e)
        return record

    workload = workloads.get(spec_run["workload"], spec.get("quick", False),
                             spec.get("max_devices", 2), spec.get("epochs"), spec.get("steps"))
    policy = spec_run.get("policy", "global")
    result = runners.run(runner, workload, n, policy)
    wall = time.perf_counter() - started
    seconds = result["epoch_seconds"]
    # after the run's own warm-up (runners.py) every epoch is warm; without one (the
    # torch reference loop) the first epoch compiles and is left out
    warm = result.get("warmup_s") is not None
    steady = seconds if warm else (seconds[1:] or seconds)
    samples = result["samples_per_epoch"]
    gbatch = common.global_batch(workload, n, policy) if runner != "reference" \
        else workload.batch
    gpu = common.has_gpu()
    precision = (flops.precision(backend if runner != "reference" else "torch", workload.kind,
                                 torch_tf32=result.get("tf32")) if gpu else "fp32")
    record = {
        "kind": "run", **spec_run, "status": "ok",
        "global_batch": gbatch, "per_device_batch": gbatch // n,
        "samples_per_epoch": samples, "steps_per_epoch": -(-samples // gbatch),
        "epoch_seconds": seconds,
        "first_epoch_s": result["warmup_s"] if warm else seconds[0],
        "warmup_s": result.get("warmup_s"),
        "samples_per_s": samples / statistics.median(steady),
        "wall_s": wall,
        "peak_memory": result["peak_memory"],
        "memory_kind": result["memory_kind"],
        "allocator_peak": result.get("allocator_peak"),
        "gpu_util": result.get("gpu_util"),
        "loss": result["loss"],
        "precision": precision,
        "peak_flops": flops.peak_flops(env.get("gpu_name"), precision) if gpu else None,
    }
    for key in ("warmup_calls_s", "warmup_epochs_s",
                "flops_per_sample", "flops_source", "flops_analytic", "params",
                "evaluate_s", "predict_s", "evaluate_first_s", "predict_first_s",
                "infer_samples"):
        if result.get(key) is not None:
            record[key] = result[key]
    weights = result["weights"]
    if record.get("params"):
        record["grad_bytes"] = record["params"] * projection.BYTES_PER_GRADIENT
    if weights and spec.get("weights_dir"):
        path = os.path.join(spec["weights_dir"], weights_name(spec_run))
        np.savez(path, *weights)
        record["weights_file"] = path
    if workload.name == "sine":
        from kmgpu import sine

        model = workload.build()
        model.set_weights(weights)
        _, (xs, ys), scale = sine.data()
        record["rmse"] = sine.rmse(model, xs, ys, scale)
    return record


def _release_memory():
    """Between runs in one process: hand cached GPU memory back (torch), collect garbage."""
    import gc

    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def weights_name(spec_run):
    return "{workload}-{runner}-{devices}-{policy}.npz".format(
        **{"policy": "global", **spec_run})


def _share_compiled_code(folder):
    """JAX's persistent compilation cache for every program, so runs that compile the
    same program (plain fit, kmgpu on one device and plain fit again; kmgpu and the
    peer) compile and autotune it once and run the same kernels: separate compiles can
    pick different kernels, a difference between runs that is not kmgpu's. The
    first epoch of a later run in the process then is no compile time (marked: it had
    runs before it)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _COMPILES.attach()


class _CompileLog:
    """What JAX's persistent compilation cache did during a run, read from the messages
    of JAX's compiler and cache-key loggers: the programs loaded from the cache (hits) and
    those compiled, with each compile's seconds, and the train step's cache key part by
    part (the program, XLA flags, compile options, ...). It says whether a later run in
    the process loaded plain fit's programs or compiled its own, and where a key
    differs, which part made it differ."""

    LOGGERS = ("jax._src.compiler", "jax._src.cache_key")
    PART = re.compile(r"get_cache_key hash of serialized (.+): ([0-9a-f]+)")
    NOT_WRITTEN = re.compile(r"Not writing persistent cache entry.*")
    ERROR = r"Error (reading|writing) persistent compilation cache entry"
    HIT = re.compile(r"[Pp]ersistent compilation cache hit for '([^']+)'")
    MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
    TOOK = re.compile(r"'([^']+)' took at least .* to compile \(([0-9.]+)s\)")

    def __init__(self):
        self.clear()

    def clear(self):
        self.hits, self.misses, self.compiled = [], [], []
        self.parts, self.train_key, self.trouble = {}, {}, []

    def attach(self):
        """Read JAX's loggers, and its warnings that a cache entry could not be read or
        written (shown even where the worker ignores warnings)."""
        import logging
        import warnings

        warnings.filterwarnings("always", message=self.ERROR)
        shown = warnings.showwarning

        def show(message, *args, **kwargs):
            if re.match(self.ERROR, str(message)):
                self.trouble.append(str(message)[:300])
            shown(message, *args, **kwargs)

        warnings.showwarning = show

        class Handler(logging.Handler):
            def emit(handler, record):
                self.read(record.getMessage())

        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(Handler(logging.DEBUG))
            logger.propagate = False  # its DEBUG lines stay out of the worker's log

    def read(self, message):
        part = self.PART.search(message)
        if part:  # the key's parts come before the hit or miss of its program
            self.parts[part.group(1)] = part.group(2)[:12]
            return
        hit, miss = self.HIT.search(message), self.MISS.search(message)
        took, not_written = self.TOOK.search(message), self.NOT_WRITTEN.search(message)
        if not_written:  # e.g. a program with host callbacks is never written
            self.trouble.append(not_written.group(0)[:300])
        elif hit or miss:
            name = (hit or miss).group(1)
            (self.hits if hit else self.misses).append(name)
            if "train_step" in name:
                self.train_key = self.parts
            self.parts = {}
        elif took:
            self.compiled.append((took.group(1), float(took.group(2))))

    def take(self):
        """{"cache_hits": n, "cache_misses": n, "compile_s": seconds, "compiled":
        [[name, seconds], ...] of the compiles over 0.1 s, "train_step_key": {part:
        hash}, "cache_trouble": [why an entry was not read or written, ...]} since the
        last take, or {} where nothing was logged."""
        taken = {"cache_hits": len(self.hits), "cache_misses": len(self.misses),
                 "compile_s": sum(s for _, s in self.compiled),
                 "compiled": [[name, s] for name, s in self.compiled if s > 0.1],
                 "train_step_key": self.train_key, "cache_trouble": self.trouble}
        logged = self.hits or self.misses or self.compiled or self.trouble
        self.clear()
        return taken if logged else {}


_COMPILES = _CompileLog()


def _one(spec_run, spec, env, before, skip):
    """One run's record: its figures, or why it was skipped or failed."""
    try:
        record = measure(spec_run, spec, env)
        record["runs_before"] = before  # > 0: this process's caches were warm
        record.update(_COMPILES.take())
    except skip as e:
        _COMPILES.take()
        record = {"kind": "run", **spec_run, "status": "skipped", "reason": str(e)}
    except Exception as e:
        traceback.print_exc()
        _COMPILES.take()
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        record = {"kind": "run", **spec_run, "status": "error",
                  "error": f"{type(e).__name__}: {message}"[:300]}
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    from kmgpu.bench import common

    common.without_tensorflow()
    if spec.get("simulate"):
        import kmgpu

        kmgpu.simulate_devices(int(spec["simulate"]))
    import warnings

    warnings.filterwarnings("ignore")
    if spec.get("jax_cache") and os.environ.get("KERAS_BACKEND") == "jax":
        _share_compiled_code(spec["jax_cache"])  # its cache's own warnings shown
    common.SIMULATED[0] = int(spec.get("simulate") or 0)
    env = environment()
    emit(env)
    _COMPILES.take()  # the set-up's own small programs belong to no run
    from kmgpu.bench.ddp import Skip

    before = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        for spec_run in json.loads(line):
            emit(_one(spec_run, spec, env, before, Skip))
            before += 1
            _release_memory()
        emit({"kind": "done"})
    sys.stdout.flush()
    sys.stderr.flush()
    # torch gloo / TF threads can abort at interpreter exit; the results are out.
    os._exit(0)


if __name__ == "__main__":
    main()

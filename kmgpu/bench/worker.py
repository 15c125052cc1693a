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
import statistics
import sys
import time
import traceback

from kmgpu.bench import compile_log

TAG = "KMGPU-BENCH "


def emit(record):
    sys.stdout.write(TAG + json.dumps(record) + "\n")
    sys.stdout.flush()


def environment():
    """The process's backend, versions and devices; ``start_s``: where this part of its
    start went (importing Keras and its backend; finding the devices and their names, the
    backend's GPU set-up included), in seconds."""
    started = time.perf_counter()
    import keras

    import kmgpu
    from kmgpu.bench import common

    backend = keras.config.backend()
    version = getattr(sys.modules.get(backend) or __import__(backend), "__version__", "?")
    imported = time.perf_counter()
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
    # the rest of a worker's start: the interpreter, kmgpu.bench, JAX's cache set-up
    info["start_s"] = {"imports": round(imported - started, 2),
                       "devices": round(time.perf_counter() - imported, 2)}
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
    for key in ("warmup_calls_s", "warmup_epochs_s", "host",
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


def _one(spec_run, spec, env, before, skip):
    """One run's record: its figures, or why it was skipped or failed."""
    try:
        record = measure(spec_run, spec, env)
        record["runs_before"] = before  # > 0: this process's caches were warm
    except skip as e:
        record = {"kind": "run", **spec_run, "status": "skipped", "reason": str(e)}
    except Exception as e:
        traceback.print_exc()
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        record = {"kind": "run", **spec_run, "status": "error",
                  "error": f"{type(e).__name__}: {message}"[:300]}
    record.update(compile_log.LOG.take())  # JAX: what its compilation cache did
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    from kmgpu.bench import common

    common.without_other_backends()
    if spec.get("simulate"):
        import kmgpu

        kmgpu.simulate_devices(int(spec["simulate"]))
    import warnings

    warnings.filterwarnings("ignore")
    if spec.get("jax_cache") and os.environ.get("KERAS_BACKEND") == "jax":
        compile_log.share_compiled_code(spec["jax_cache"])  # its warnings still shown
    common.SIMULATED[0] = int(spec.get("simulate") or 0)
    env = environment()
    emit(env)
    compile_log.LOG.take()  # the set-up's own small programs belong to no run
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

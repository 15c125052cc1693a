"""One backend's benchmark runs, in one process (``KERAS_BACKEND`` is fixed per process).

    KERAS_BACKEND=jax python -m benchmarks.worker SPEC.json

SPEC: {"runs": [{"workload", "runner", "devices"}, ...], "quick": bool,
"simulate": int (0: real devices), "weights_dir": folder for the final weights}.
Prints one line ``KMGPU-BENCH {json}`` for the environment, then one per run, as each
finishes; everything else it prints is log.
"""

import json
import os
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

    backend = keras.config.backend()
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend]
    version = getattr(sys.modules.get(module) or __import__(module), "__version__", "?")
    info = {"kind": "env", "backend": backend, "keras": keras.__version__,
            "backend_version": version, "devices": kmgpu.devices()}
    try:
        if backend == "jax":
            import jax

            info["device_kinds"] = sorted({d.device_kind for d in jax.devices()})
        elif backend == "torch":
            import torch

            if torch.cuda.is_available():
                info["device_kinds"] = [torch.cuda.get_device_name(0)]
                info["cuda"] = torch.version.cuda
    except Exception:
        pass
    return info


def measure(spec_run, quick, weights_dir):
    import numpy as np

    from benchmarks import runners, workloads

    workload = workloads.get(spec_run["workload"], quick)
    n = spec_run["devices"]
    started = time.perf_counter()
    result = runners.run(spec_run["runner"], workload, n)
    wall = time.perf_counter() - started
    seconds = result["epoch_seconds"]
    steady = seconds[1:] or seconds
    samples = len(workload.data()[0])
    record = {
        "kind": "run", **spec_run, "status": "ok",
        "samples_per_epoch": samples,
        "epoch_seconds": seconds,
        "first_epoch_s": seconds[0],
        "samples_per_s": samples / statistics.median(steady),
        "wall_s": wall,
        "peak_memory": result["peak_memory"],
        "memory_kind": result["memory_kind"],
        "allocator_peak": result.get("allocator_peak"),
        "gpu_util": result.get("gpu_util"),
        "loss": result["loss"],
    }
    weights = result["weights"]
    if weights_dir:
        path = os.path.join(weights_dir, weights_name(spec_run))
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
    return "{workload}-{runner}-{devices}.npz".format(**spec_run)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec.get("simulate"):
        import kmgpu

        kmgpu.simulate_devices(int(spec["simulate"]))
    import warnings

    warnings.filterwarnings("ignore")
    emit(environment())
    for spec_run in spec["runs"]:
        try:
            record = measure(spec_run, spec.get("quick", False), spec.get("weights_dir"))
        except Exception as e:
            traceback.print_exc()
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            record = {"kind": "run", **spec_run, "status": "error",
                      "error": f"{type(e).__name__}: {message}"[:300]}
        emit(record)
        _release_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch gloo / TF threads can abort at interpreter exit; the results are out.
    os._exit(0)


if __name__ == "__main__":
    main()

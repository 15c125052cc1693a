"""What the Keras-based runners (``runners.py``) and the torch-only loops (``ddp.py``)
share: the peers' names, the global batch of a policy, whether there is a real GPU, and
how a run's timings and memory become its result."""

PEER_NAMES = {
    "tensorflow": "tf.distribute.MirroredStrategy + fit",
    "jax": "keras.distribution.DataParallel + fit",
    "torch": "hand-written DDP loop (keras.io guide)",
}
SIMULATED = [0]  # simulated devices in this process (the worker sets it)


def global_batch(workload, n, policy):
    """The global batch of ``workload`` on ``n`` devices under batch ``policy``."""
    return workload.batch * n if policy == "per_replica" else workload.batch


def without_other_backends():
    """In a JAX or torch process of the bench (a worker, a DDP rank): ``import tensorflow``
    raises ImportError, which Keras takes as "not installed"; in a torch process so does
    ``import jax``. No run of theirs uses them, but ``keras.utils.set_random_seed`` (every
    workload's model) imports TensorFlow where it is installed, only to seed it (5-6 s of a
    2-core CPU per process, and its thread pools), and ``import keras`` imports JAX where it
    is installed, only to patch its monitoring (1-2 s of each torch worker's start)."""
    import os
    import sys

    backend = os.environ.get("KERAS_BACKEND")
    if backend in ("jax", "torch"):
        sys.modules.setdefault("tensorflow", None)
    if backend == "torch":
        sys.modules.setdefault("jax", None)


def has_gpu():
    """A real GPU runs this process's work (not simulated devices): NVML sees one, or the
    backend already imported here does (when nvidia-ml-py is missing)."""
    import sys

    from kmgpu.callbacks import nvidia_gpus

    if SIMULATED[0]:
        return False
    if nvidia_gpus():
        return True
    try:
        if "jax" in sys.modules:
            return any(d.platform == "gpu" for d in sys.modules["jax"].devices())
        if "torch" in sys.modules:
            return sys.modules["torch"].cuda.is_available()
        if "tensorflow" in sys.modules:
            return bool(sys.modules["tensorflow"].config.list_physical_devices("GPU"))
    except Exception:
        pass
    return False


def collect(epoch_seconds, peak, kind, monitor, loss):
    """Peak memory: the GPU's memory in use as nvidia-smi shows it (NVML, sampled every
    0.2 s; the most loaded GPU), where there is one; else ``peak`` (the allocator's or
    the process's RSS). The allocator's own peak is kept as ``allocator_peak``."""
    result = {"epoch_seconds": [float(s) for s in epoch_seconds], "loss": loss,
              "peak_memory": int(peak), "memory_kind": kind or "rss"}
    if kind == "gpu":
        result["allocator_peak"] = int(peak)
    if monitor is not None and monitor.per_gpu:
        gpus = list(monitor.per_gpu.values())
        result["peak_memory"] = int(max(g["mem_peak_mib"] for g in gpus) * 2**20)
        result["memory_kind"] = "nvml"
        result["gpu_util"] = sum(g["util_mean"] for g in gpus) / len(gpus)
    return result

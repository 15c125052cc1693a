"""JAX's devices, simulated devices, memory and multi-process start-up.

The same plain functions as every backend's ``runtime.py``. Nothing here imports
JAX at module import time.
"""

import os
import sys


def physical_devices():
    """The devices ``gpus=None`` would use: [("gpu", i), ...] or [("cpu", i), ...]."""
    import jax

    return [(d.platform if d.platform != "cuda" else "gpu", i)
            for i, d in enumerate(jax.devices())]


def simulate(n):
    """Ask XLA for ``n`` host devices (``--xla_force_host_platform_device_count``).

    Returns:
        None, or what JAX already set up (a description) when it is too late.
    """
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            have = jax.devices()
            if len(have) == n and have[0].platform == "cpu":
                return None
            return f"{len(have)} {have[0].platform} device(s)"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    return None


def peak_memory():
    """Device 0's allocator peak in bytes, or None without a GPU."""
    try:
        import jax

        device = jax.local_devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        if stats and "peak_bytes_in_use" in stats:
            return int(stats["peak_bytes_in_use"])
    except Exception:
        pass
    return None


def reset_peak_memory():
    """JAX has no way to restart its peak counter: nothing to do."""


def start_job(job):
    """``jax.distributed`` through ``keras.distribution.initialize``, before JAX starts.

    Process 0 serves the coordinator on MASTER_PORT + 1 (under torchrun, MASTER_PORT
    itself is torchrun's store).

    Args:
        job: this process's ``kmgpu.environment.Job``.
    """
    import keras

    from kmgpu.engines import model_fixes

    keras.distribution.initialize(f"{job.master_addr}:{job.master_port + 1}",
                                  job.world, job.rank)
    model_fixes.warm_saving()


def multiprocess():
    """True when JAX runs several processes (jax.distributed is initialised)."""
    import jax

    return jax.process_count() > 1


def put_global(data, mesh, batch_axis):
    """Place each global batch on the mesh of every process's devices.

    Every process holds the same full batch; each gives its own devices their rows
    (``make_array_from_callback``), sharded along the batch axis when the device
    count divides it, replicated otherwise (the single-process rule).
    """
    import jax
    import keras
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.devices.size

    def put(d):
        if d is None:
            return None
        d = np.asarray(d)
        spec = PartitionSpec(batch_axis) if d.shape and d.shape[0] % n == 0 else PartitionSpec()
        return jax.make_array_from_callback(d.shape, NamedSharding(mesh, spec),
                                            lambda index: d[index])

    return keras.tree.map_structure(put, data)

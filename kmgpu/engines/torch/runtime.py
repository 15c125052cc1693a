"""torch's devices, simulated devices, memory and multi-process start-up.

The same plain functions as every backend's ``runtime.py``. Nothing here imports
torch at module import time.
"""

import os
import sys


def physical_devices():
    """The devices ``gpus=None`` would use: simulated gloo ranks, CUDA GPUs, or the CPU."""
    import torch

    from kmgpu import environment

    n_sim = environment.simulated_count()
    if n_sim:
        return [("cpu", i) for i in range(n_sim)]
    if torch.cuda.is_available():
        return [("gpu", i) for i in range(torch.cuda.device_count())]
    return [("cpu", 0)]


def simulate(n):
    """Simulated torch devices are gloo processes, started later: only the count is kept.

    Returns:
        None, or the count already in use when engines and worker pools exist for it.
    """
    from kmgpu import environment

    have = environment.simulated_count()
    if have not in (0, n) and "keras" in sys.modules:
        return f"{have} simulated device(s)"
    return None


def peak_memory():
    """This process's CUDA allocator peak in bytes, or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except Exception:
        pass
    return None


def reset_peak_memory():
    """Restart the CUDA allocator's peak counter."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
    except Exception:
        pass


def start_job(job):
    """torch joins the process group in its engine, from torchrun's variables: set them.

    Args:
        job: this process's ``kmgpu.environment.Job``.
    """
    os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world),
                      LOCAL_RANK=str(job.local_rank), MASTER_ADDR=job.master_addr,
                      MASTER_PORT=str(job.master_port), LOCAL_WORLD_SIZE=str(job.local_world))

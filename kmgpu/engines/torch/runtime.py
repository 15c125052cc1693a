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


#: the process group ``join_group`` started: left at exit unless a call failed (``broken``)
_GROUP = {"owned": False, "broken": False}


def join_group():
    """Join torchrun's process group from its variables, as one rank of the job (a
    group the user started is used as it is).

    The group's collectives and its start wait at most ``KMGPU_COLLECTIVE_TIMEOUT``
    for the other processes: after one dies or hangs, the others fail within that
    bound. On a GPU this rank takes GPU ``LOCAL_RANK``; local rank 0 says once when
    the host has more GPUs than the job runs processes on it.

    Returns:
        (gpu, this rank's torch device, whether this call started the group).
    """
    import atexit

    import torch
    import torch.distributed as dist

    from kmgpu import environment

    gpu = torch.cuda.is_available() and not environment.simulated_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local_rank)
        _say_idle_gpus(torch.cuda.device_count(), local_rank)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if gpu else "gloo", init_method="env://",
                                timeout=environment.collective_timeout())
        _GROUP["owned"] = True
        atexit.register(leave_group)  # no gloo/NCCL abort at exit
    return gpu, f"cuda:{torch.cuda.current_device()}" if gpu else "cpu", started


def _say_idle_gpus(visible, local_rank):
    used = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if visible > used and local_rank == 0:
        print(f"kmgpu: this host has {visible} GPUs and the job runs {used} process(es) on "
              f"it, one GPU each: {visible - used} stay idle (kmgpu launch starts one "
              "process per GPU unless --nproc-per-node says otherwise).", file=sys.stderr,
              flush=True)


def mark_broken():
    """A call failed: peers may be left inside a collective, so the group is not left
    with a barrier at exit (this process would wait on them, and they on it)."""
    _GROUP["broken"] = True


def leave_group():
    """The group ``join_group`` started: leave it together (barrier, destroy)."""
    if not _GROUP["owned"]:
        return
    import datetime

    import torch.distributed as dist

    _GROUP["owned"] = False
    if dist.is_initialized() and not _GROUP["broken"]:
        try:  # bounded: after a peer died, a plain barrier waits for the group's timeout
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            else:
                dist.barrier()
            dist.destroy_process_group()
        except RuntimeError:
            pass  # a peer is gone: this process is ending anyway

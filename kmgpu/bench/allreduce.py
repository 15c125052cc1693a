"""All-reduce time against message size on the run's devices, the backend's own way:

    torch  ``torch.distributed.all_reduce`` (NCCL on GPUs, gloo on CPUs), one process
           per device (as DDP runs it)
    jax    ``jax.lax.psum`` in a ``shard_map`` over the devices (XLA -> NCCL on GPUs)

For each size: two warm-up calls, then ``repeats`` calls back to back, synchronised at the
end; the time of one call is the total over ``repeats``. The sweep's fit
(``projection.fit_alpha_beta``) gives the latency alpha and bus bandwidth busbw that the
projection to more GPUs uses.
"""

import json
import os
import tempfile
import time

GPU_SIZES = tuple(4**k for k in range(6, 15))  # 4 KiB .. 256 MiB
CPU_SIZES = tuple(4**k for k in range(6, 13))  # 4 KiB .. 16 MiB


def sizes_and_repeats(gpu):
    sizes = GPU_SIZES if gpu else CPU_SIZES
    return [(m, 20 if m <= 16 * 2**20 else 5) if gpu else (m, 3) for m in sizes]


def sweep(backend, n, gpu):
    """{"method", "points": [(bytes, seconds), ...]} for an all-reduce over ``n`` devices."""
    if n < 2:
        raise ValueError("an all-reduce sweep needs 2 or more devices")
    plan = sizes_and_repeats(gpu)
    if backend == "torch":
        return {"method": "torch.distributed.all_reduce (" + ("nccl" if gpu else "gloo") + ")",
                "points": _torch(n, plan, gpu)}
    if backend == "jax":
        return {"method": "jax.lax.psum in shard_map", "points": _jax(n, plan)}
    from kmgpu.bench.ddp import Skip

    raise Skip(f"no all-reduce sweep for {backend}")


def _jax(n, plan):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map
    spec = PartitionSpec("d")
    reduce = jax.jit(shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=spec,
                               out_specs=spec))
    points = []
    for size, repeats in plan:
        count = max(1, size // 4)
        x = jax.device_put(jnp.ones((n * count,), jnp.float32), NamedSharding(mesh, spec))
        for _ in range(2):
            x = reduce(x)
        x.block_until_ready()
        started = time.perf_counter()
        for _ in range(repeats):
            x = reduce(x)
        x.block_until_ready()
        points.append((count * 4, (time.perf_counter() - started) / repeats))
        del x
    return points


def _torch(n, plan, gpu):
    from kmgpu.bench import ddp

    with tempfile.TemporaryDirectory(prefix="kmgpu-allreduce-") as tmp:
        out = os.path.join(tmp, "sweep.json")
        ddp.start(_torch_rank, n, (plan, out), gpu)
        with open(out) as f:
            return [tuple(p) for p in json.load(f)]


def _torch_rank(rank, world, cuda, plan, out):
    import torch
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    points = []
    for size, repeats in plan:
        count = max(1, size // 4)
        x = torch.ones(count, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        sync()
        points.append((count * 4, (time.perf_counter() - started) / repeats))
        del x
    if rank == 0:
        with open(out, "w") as f:
            json.dump(points, f)

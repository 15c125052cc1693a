"""The ways to train a workload that ``kmgpu bench`` compares, all measured alike.

    plain    ``model.fit`` on one device: what kmgpu's overhead is measured against.
    replay   plain ``model.fit`` once more: how much two identical runs differ (timing
             noise, and the parity floor where GPU kernels are not deterministic).
    kmgpu    ``kmgpu.parallelize(model, gpus=n)`` then ``fit``.
    peer     the framework's own data-parallel way, written by hand:
             tensorflow  ``tf.distribute.MirroredStrategy`` (model built and compiled
                         in the scope, as the Keras/TF guides do), then ``fit``;
             jax         ``keras.distribution.DataParallel`` scope, then ``fit``;
             torch       the DistributedDataParallel loop of the keras.io guide
                         "Multi-GPU distributed training with PyTorch": one process per
                         device, ``DistributedSampler``, a torch optimizer and loss.

Every run starts from the same initial weights (the workload's seed), sees the same
data in the same order (``shuffle=False``) at the same global batch, and records each
epoch's wall time, peak memory, the last loss and the final weights.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np

PEER_NAMES = {
    "tensorflow": "tf.distribute.MirroredStrategy + fit",
    "jax": "keras.distribution.DataParallel + fit",
    "torch": "hand-written DDP loop (keras.io guide)",
}


def run(runner, workload, n):
    """Train ``workload`` on ``n`` devices with ``runner``.

    Returns:
        dict(epoch_seconds=[...], peak_memory=bytes, memory_kind="nvml"|"gpu"|"rss",
        allocator_peak=bytes (where known), gpu_util=% (with NVML), loss=float,
        weights=[np.ndarray, ...]).
    """
    model = workload.build()  # outside any scope: the same weights in every process
    init = model.get_weights()
    if runner in ("plain", "replay"):  # replay: plain fit again, for the noise floor
        if n != 1:
            raise ValueError("plain model.fit runs on one device")
        return _plain(workload, model)
    if runner == "kmgpu":
        return _kmgpu(workload, n, model)
    if runner == "peer":
        import keras

        backend = keras.config.backend()
        return {"tensorflow": _mirrored, "jax": _data_parallel, "torch": _torch_ddp}[backend](
            workload, n, init)
    raise ValueError(f"unknown runner {runner!r}")


# -- Keras fit based ---------------------------------------------------------------
def _fit(fit, x, y, workload):
    from kmgpu.callbacks import EpochTimer, GPUMonitor, reset_peak_memory

    reset_peak_memory()
    timer, monitor = EpochTimer(len(x)), GPUMonitor(interval=0.2, verbose=0)
    history = fit(x, y, batch_size=workload.batch, epochs=workload.epochs, shuffle=False,
                  verbose=0, callbacks=[timer, monitor])
    # Read the callbacks themselves: an engine that trains in worker processes runs
    # them here but need not copy what they add to the logs into its History.
    return _collect(timer.epoch_seconds, timer.peak_memory, timer.memory_kind, monitor,
                    float(history.history["loss"][-1]))


def _collect(epoch_seconds, peak, kind, monitor, loss):
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


def _plain(workload, model):
    model.compile(**workload.compile_args())
    x, y = workload.data()
    result = _fit(model.fit, x, y, workload)
    result["weights"] = model.get_weights()
    return result


def _kmgpu(workload, n, model):
    import warnings

    import kmgpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "one device - running as a single replica"
        parallel = kmgpu.parallelize(model, gpus=n)
    parallel.compile(**workload.compile_args())
    x, y = workload.data()
    try:
        result = _fit(parallel.fit, x, y, workload)
    finally:
        if _has_gpu():
            parallel.close()  # free the GPUs for the next run's memory figures
        # else: the torch engine's worker pool stays for the next run on as many devices

    result["weights"] = model.get_weights()  # the user's model holds the trained weights
    return result


def _has_gpu():
    from kmgpu.callbacks import nvidia_gpus
    from kmgpu import hardware

    return bool(nvidia_gpus()) and not hardware.simulated_count()


def _mirrored(workload, n, init):
    """The hand-written MirroredStrategy script."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))[:n]]
    if len(devices) < n:
        raise ValueError(f"{n} devices asked for, {len(devices)} exist")
    # On GPUs MirroredStrategy's default all-reduce (NCCL); logical CPUs need another.
    ops = None if gpus else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        model = workload.build()
        model.set_weights(init)
        model.compile(**workload.compile_args())
    x, y = workload.data()
    result = _fit(model.fit, x, y, workload)
    result["weights"] = model.get_weights()
    return result


def _data_parallel(workload, n, init):
    """keras.distribution.DataParallel, as the Keras distribution guide shows it."""
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices()[:n])
    with distribution.scope():
        model = workload.build()
        model.set_weights(init)
        model.compile(**workload.compile_args())
        x, y = workload.data()
        result = _fit(model.fit, x, y, workload)
        result["weights"] = model.get_weights()
    return result


# -- torch: the keras.io guide's DDP loop ------------------------------------------------
def _torch_ddp(workload, n, init):
    import torch

    from kmgpu import hardware

    cuda = torch.cuda.is_available() and not hardware.simulated_count()
    if cuda and torch.cuda.device_count() < n:
        raise ValueError(f"{n} GPUs asked for, {torch.cuda.device_count()} exist")
    with tempfile.TemporaryDirectory(prefix="kmgpu-ddp-") as tmp:
        out = os.path.join(tmp, "rank0.npz")
        port = str(_free_port())
        if n == 1:
            # One process: the guide's function, run here instead of in a child.
            _ddp_process(0, 1, workload, init, cuda, port, out)
        else:
            import torch.multiprocessing as mp

            # The guide forks; forking a process that has already run CUDA or torch's
            # OpenMP threads (as this one has: it built the model) can hang. On CPUs a
            # fork server that has only imported the libraries starts ranks fast and
            # safely; with GPUs, spawn (a fresh interpreter per rank, CUDA untouched).
            method = "spawn" if cuda else "forkserver"
            if method == "forkserver":
                mp.set_forkserver_preload(["torch", "keras", "benchmarks.runners"])
            mp.start_processes(_ddp_process, args=(n, workload, init, cuda, port, out),
                               nprocs=n, join=True, start_method=method)
        saved = np.load(out, allow_pickle=False)
        result = json.loads(str(saved["summary"]))
        result["weights"] = [saved[f"w{i}"] for i in range(int(saved["count"]))]
        return result


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_process(rank, world, workload, init, cuda, port, out):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                            world_size=world, rank=rank)
    try:
        _ddp_train(rank, world, workload, init, cuda, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if world > 1:
        sys.stdout.flush()
        os._exit(0)  # gloo children can abort at interpreter exit (DESIGN.md §3)


def _ddp_train(rank, world, workload, init, cuda, out):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from kmgpu.callbacks import peak_memory

    if not cuda:  # ranks share the CPU cores (the guide is written for GPUs)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    x, y = workload.data()
    dataset = TensorDataset(torch.from_numpy(x),
                            torch.from_numpy(y.astype("int64") if y.dtype.kind == "i" else y))
    from kmgpu.callbacks import GPUMonitor

    per_device = workload.batch // world
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, sampler=sampler, batch_size=per_device, shuffle=False)

    model = workload.build()
    model.set_weights(init)
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    model = model.to(device)
    ddp = DDP(model, device_ids=[rank] if cuda else None)
    # Keras's Adam has epsilon 1e-7; torch's default is 1e-8.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    loss_fn = (torch.nn.CrossEntropyLoss() if workload.loss == "sparse_ce_logits"
               else torch.nn.MSELoss())
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    monitor = GPUMonitor(interval=0.2, verbose=0) if (rank == 0 and cuda) else None
    if monitor:
        monitor.on_train_begin()
    epoch_seconds, loss_value = [], float("nan")
    for epoch in range(workload.epochs):
        if monitor:
            monitor.on_epoch_begin(epoch)
        start = time.perf_counter()
        running, count = 0.0, 0
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            outputs = ddp(inputs, training=True)  # the guide omits training=True (BatchNorm)
            loss = loss_fn(outputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
            count += 1
        loss_value = running / max(count, 1)
        epoch_seconds.append(time.perf_counter() - start)
        if monitor:
            monitor.on_epoch_end(epoch, {})
    if rank == 0:
        if monitor:
            monitor.on_train_end()
        peak, kind = peak_memory()
        summary = _collect(epoch_seconds, peak, kind, monitor, loss_value)
        weights = model.get_weights()
        np.savez(out, count=len(weights), summary=json.dumps(summary),
                 **{f"w{i}": w for i, w in enumerate(weights)})

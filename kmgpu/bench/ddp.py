"""torch without Keras's ``fit``: the keras.io guide's DistributedDataParallel loop (the
torch peer), torchvision's ResNet-50 in a plain loop (the pure-framework reference), and
the process group plumbing they share with the all-reduce sweep (``allreduce.py``).
"""

import json
import os
import sys
import tempfile
import time

import numpy as np


class Skip(Exception):
    """The run cannot happen here; the message says why (recorded as "skipped")."""


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target, world, args, cuda):
    """Run ``target(rank, world, cuda, *args)`` in ``world`` processes joined in a process
    group (NCCL on GPUs, gloo on CPUs); with world 1, here in this process."""
    port = str(free_port())
    if world == 1:
        _process(0, 1, target, args, cuda, port)
        return
    import torch.multiprocessing as mp

    # The guide forks; forking a process that has already run CUDA or torch's OpenMP
    # threads (as this one has: it built the model) can hang. On CPUs a fork server that
    # has only imported the libraries starts ranks fast and safely; with GPUs, spawn (a
    # fresh interpreter per rank, CUDA untouched).
    method = "spawn" if cuda else "forkserver"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "keras", "kmgpu.bench.ddp"])
    mp.start_processes(_process, args=(world, target, args, cuda, port), nprocs=world,
                       join=True, start_method=method)


def _process(rank, world, target, args, cuda, port):
    import torch
    import torch.distributed as dist

    from kmgpu.bench import common

    common.without_other_backends()

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                            world_size=world, rank=rank)
    try:
        target(rank, world, cuda, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if world > 1:
        sys.stdout.flush()
        os._exit(0)  # gloo children can abort at interpreter exit (DESIGN.md section 3)


def _saved_result(path):
    saved = np.load(path, allow_pickle=False)
    result = json.loads(str(saved["summary"]))
    result["weights"] = [saved[f"w{i}"] for i in range(int(saved["count"]))]
    return result


def _save_result(path, summary, weights):
    np.savez(path, count=len(weights), summary=json.dumps(summary),
             **{f"w{i}": w for i, w in enumerate(weights)})


# -- the peer: the keras.io guide's DDP loop ---------------------------------------------
def peer(workload, n, init, policy, cuda):
    import torch

    if cuda and torch.cuda.device_count() < n:
        raise ValueError(f"{n} GPUs asked for, {torch.cuda.device_count()} exist")
    with tempfile.TemporaryDirectory(prefix="kmgpu-ddp-") as tmp:
        out = os.path.join(tmp, "rank0.npz")
        start(_ddp_train, n, (workload, init, policy, out), cuda)
        return _saved_result(out)


def _loss_fn(workload):
    import torch

    if workload.loss != "sparse_ce_logits":
        return torch.nn.MSELoss()
    ce = torch.nn.CrossEntropyLoss()

    def loss(outputs, targets):  # (batch, [positions,] classes): every position counts
        return ce(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))

    return loss


def _ddp_train(rank, world, cuda, workload, init, policy, out):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from kmgpu.bench import common
    from kmgpu.callbacks import GPUMonitor, peak_memory

    if not cuda:  # ranks share the CPU cores (the guide is written for GPUs)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    per_replica = policy == "per_replica"
    x, y = workload.data(common.global_batch(workload, world, policy))
    dataset = TensorDataset(torch.from_numpy(x),
                            torch.from_numpy(y.astype("int64") if y.dtype.kind == "i" else y))
    per_device = workload.batch if per_replica else workload.batch // world
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, sampler=sampler, batch_size=per_device, shuffle=False)

    model = workload.build()
    model.set_weights(init)
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    model = model.to(device)
    ddp = DDP(model, device_ids=[rank] if cuda else None)
    # Keras's Adam has epsilon 1e-7; torch's default is 1e-8.
    lr = 1e-3 * (world if per_replica else 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7)
    loss_fn = _loss_fn(workload)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    monitor = GPUMonitor(interval=0.2, verbose=0) if (rank == 0 and cuda) else None
    if monitor:
        monitor.on_train_begin()
    epoch_seconds, loss_value = [], float("nan")
    for epoch in range(workload.epochs):
        if monitor:
            monitor.on_epoch_begin(epoch)
        started = time.perf_counter()
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
        epoch_seconds.append(time.perf_counter() - started)
        if monitor:
            monitor.on_epoch_end(epoch, {})
    if rank == 0:
        if monitor:
            monitor.on_train_end()
        peak, kind = peak_memory()
        summary = common.collect(epoch_seconds, peak, kind, monitor, loss_value)
        summary["samples_per_epoch"] = len(x)
        _save_result(out, summary, model.get_weights())


# -- the reference: torchvision ResNet-50 in a plain loop ---------------------------------
def reference(workload, n, cuda):
    """torchvision ``resnet50(weights=None)`` on the workload's data: channels_last, Adam
    (Keras's epsilon), cross-entropy, the batches copied to the GPU step by step as ``fit``
    does; one device."""
    if not workload.name.startswith("resnet50"):
        raise Skip(f"no pure-framework reference for {workload.name}")
    if n != 1:
        raise Skip("the reference runs on one device")
    import torch

    try:
        import torchvision
    except Exception as e:  # not installed, or built for another torch
        raise Skip(f"torchvision does not import ({type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''})"[:200]
                   + f"; to run it: pip install torchvision (the release made for torch "
                     f"{torch.__version__.split('+')[0]})") from None
    from torch.utils.flop_counter import FlopCounterMode

    from kmgpu.bench import common
    from kmgpu.callbacks import GPUMonitor

    torch.manual_seed(1234)
    device = torch.device("cuda:0" if cuda else "cpu")
    model = torchvision.models.resnet50(weights=None, num_classes=workload.classes)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = workload.data()
    # NHWC numpy -> NCHW tensors that are channels_last in memory (no copy).
    xs = torch.from_numpy(x).permute(0, 3, 1, 2)
    ys = torch.from_numpy(y.astype("int64"))
    batch = workload.batch
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    monitor = GPUMonitor(interval=0.2, verbose=0) if cuda else None
    if monitor:
        monitor.on_train_begin()
    model.train()
    epoch_seconds, loss_value = [], float("nan")
    for epoch in range(workload.epochs):
        if monitor:
            monitor.on_epoch_begin(epoch)
        started = time.perf_counter()
        for i in range(0, len(xs), batch):
            inputs = xs[i:i + batch].to(device, non_blocking=True)
            inputs = inputs.contiguous(memory_format=torch.channels_last)
            targets = ys[i:i + batch].to(device, non_blocking=True)
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        loss_value = float(loss.item())  # synchronises: the epoch's work is done
        epoch_seconds.append(time.perf_counter() - started)
        if monitor:
            monitor.on_epoch_end(epoch, {})
    if monitor:
        monitor.on_train_end()
    if cuda:
        peak, kind = int(torch.cuda.max_memory_allocated()), "gpu"
    else:
        import resource

        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"
    result = common.collect(epoch_seconds, peak, kind, monitor, loss_value)
    result["samples_per_epoch"] = len(x)
    sample = xs[:2].to(device).contiguous(memory_format=torch.channels_last)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(sample), ys[:2].to(device)).backward()
    optimizer.zero_grad(set_to_none=True)
    result["flops_per_sample"] = counter.get_total_flops() / 2
    result["flops_source"] = "torch.utils.flop_counter.FlopCounterMode"
    result["weights"] = []
    result["params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return result

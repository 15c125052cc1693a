"""``kmgpu launch``: one training script on several processes or hosts.

    kmgpu launch [--nnodes N] [--node-rank R] [--nproc-per-node P] [--max-restarts K]
                 [--master-addr A] [--master-port PORT] script.py [args ...]

Run it once on every host, with torchrun's meanings. Each backend's own
multi-process engine does the work; this module only prepares its environment:

- torch: hands the command line to ``torch.distributed.run`` (torchrun), one process
  per local GPU unless ``--nproc-per-node`` says otherwise (1 on a host without
  GPUs); kmgpu's torch engine then runs in-process, one rank per process.
- TensorFlow: one ``TF_CONFIG`` per worker, and ``MultiWorkerMirroredStrategy``
  created before the script runs (TensorFlow refuses it once any op has run).
- JAX: ``keras.distribution.initialize`` (``jax.distributed``) with the
  coordinator ``A:PORT``, the process count and this process's id, before the
  script builds anything (JAX refuses it once its backend is up).

TensorFlow and JAX run one process per host, which uses every GPU of the host.

Inside a job -- started by ``kmgpu launch``, by torchrun (``RANK`` ...) or by SLURM's
``srun`` (``SLURM_PROCID`` ...) -- ``kmgpu launch script.py`` starts no process: it
initialises this one and runs the script in it; a script that fails ends its process
at once, so that the others see it gone. Which process this is (``job()``,
``process_index()``) lives in ``kmgpu.environment``; starting each backend's
multi-process runtime in its engine's ``runtime.start_job``.
"""

import argparse
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback

from kmgpu.environment import DEFAULT_PORT, job, tf_config


# -- the command line -----------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(
        prog="kmgpu launch",
        description="Run a training script on several processes or hosts, with torchrun's "
                    "options. Run it once on every host; inside torchrun or srun it runs "
                    "the script in this process.")
    p.add_argument("--nnodes", type=int, default=1, help="number of hosts (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    p.add_argument("--nproc-per-node", default=None,
                   help="processes on this host: a number, or 'gpu' (torch: one per local "
                        "GPU). Default: torch one per local GPU (1 on a host without GPUs); "
                        "TensorFlow and JAX 1, a process that uses every local GPU")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torch: restart every process this many times after one fails "
                        "(torchrun's option; resume with keras.callbacks.BackupAndRestore). "
                        "Default 0")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of host 0, reachable from every host (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT,
                   help=f"a free port on host 0 (default {DEFAULT_PORT}); TensorFlow workers "
                        "also use the next nnodes*nproc-per-node ports")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def parse_args(argv):
    """Parse and check ``kmgpu launch`` arguments.

    Raises:
        ValueError: saying what to pass instead.
    """
    args = _parser().parse_args(argv)
    if args.nnodes < 1:
        raise ValueError(f"--nnodes {args.nnodes}: pass the number of hosts, 1 or more.")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: give each "
                         f"host its own index from 0 to {args.nnodes - 1} (host 0 is the "
                         "one at --master-addr).")
    if args.nproc_per_node not in (None, "gpu"):
        text = args.nproc_per_node
        args.nproc_per_node = int(text) if text.strip().lstrip("-").isdigit() else 0
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node {text}: pass 1 or more, or 'gpu' (torch: "
                             "one process per local GPU), or leave it out.")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: pass 0 (the default) or more.")
    if not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port {args.master_port}: pass a free TCP port, 1..65535.")
    if not os.path.isfile(args.script):
        raise ValueError(f"script {args.script!r} not found: pass the path of the Python "
                         "script to run, the same on every host.")
    return args


def main(argv=None):
    """``kmgpu launch``: run a training script on several processes or hosts through the
    backend's own runtime (torchrun, TF_CONFIG, jax.distributed); ``kmgpu launch --help``.

    Args:
        argv: the command's arguments.

    Returns:
        The exit status: the script's, or 2 for bad arguments.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except ValueError as e:
        _parser().error(str(e))
    from kmgpu import hardware

    backend = hardware.backend_name()
    if job() is not None:
        return run_here(backend, args.script, args.args)
    try:
        args.nproc_per_node = processes_per_host(backend, args.nproc_per_node, args.max_restarts)
    except ValueError as e:
        _parser().error(str(e))
    if backend == "torch":
        if args.max_restarts:
            # each attempt's processes meet in a store of their own: in the store the
            # rendezvous shares by default, a restarted process may read the address
            # the last attempt's rank 0 left there, and fail to connect to it
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        os.execv(sys.executable, [sys.executable] + torchrun_argv(args))
    return spawn(args, backend)


def processes_per_host(backend, asked, max_restarts=0, local_gpus=None):
    """The processes ``kmgpu launch`` starts on this host.

    Args:
        backend: the Keras backend.
        asked: ``--nproc-per-node``: None (not given), "gpu" or a number.
        max_restarts: ``--max-restarts`` (torch only).
        local_gpus: the host's GPU count (default: torch's, for torch).

    Returns:
        torch: "gpu" (torchrun's one process per local GPU) where the host has GPUs and
        nothing else was asked, else the number; TensorFlow and JAX: the number (1
        unless asked).

    Raises:
        ValueError: "gpu" or restarts asked of TensorFlow or JAX, or "gpu" on a torch
            host without GPUs, saying what to pass instead.
    """
    if backend != "torch":
        if asked == "gpu":
            raise ValueError(f"--nproc-per-node gpu: with {backend}, one process per host "
                             "uses every local GPU; leave the option out (1).")
        if max_restarts:
            raise ValueError(f"--max-restarts: torchrun's restarts serve the torch backend; "
                             f"with {backend}, start the job again (BackupAndRestore resumes "
                             "it).")
        return asked or 1
    if asked not in (None, "gpu"):
        return asked
    if local_gpus is None:
        import torch

        local_gpus = torch.cuda.device_count()
    if local_gpus:
        return "gpu"
    if asked == "gpu":
        raise ValueError("--nproc-per-node gpu: this host has no GPU torch can use; pass a "
                         "number of processes, or leave the option out (1).")
    return 1


def torchrun_argv(args):
    """The torchrun command line for ``kmgpu launch`` arguments (torch backend).

    Each process runs the script through ``kmgpu.commands.launch`` (``run_here``), as
    on the other backends: a failing script ends its process at once instead of
    waiting at exit for a collective the others will not finish. With restarts, the
    hosts meet through torchrun's c10d rendezvous at ``--master-addr:--master-port``
    (its static one keeps the first attempt's addresses in its store, and a restarted
    process connects to a peer that is gone); the rendezvous numbers the hosts.
    """
    if args.max_restarts:
        where = ["--max-restarts", str(args.max_restarts), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"{args.master_addr}:{args.master_port}",
                 "--rdzv-id", f"kmgpu-{args.master_port}"]
    else:
        where = ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                 "--master-port", str(args.master_port)]
    return (["-m", "torch.distributed.run", "--nnodes", str(args.nnodes),
             "--nproc-per-node", str(args.nproc_per_node)] + where
            + ["-m", "kmgpu.commands.launch", args.script] + list(args.args))


# -- inside a job: initialise this process, then run the script ------------------------
def run_here(backend, script, script_args):
    """Start the backend's multi-process runtime here, then run ``script`` as __main__.

    A failing script ends the process at once with status 1 (its traceback on
    stderr), without Python's exit: that waits for the collectives still pending in
    the process (torch's process group), and a peer waiting on this process would
    keep it there, and it the peer, until the group's timeout.
    """
    from kmgpu import engines

    j = job()
    engines.runtime(backend).start_job(j)
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _die(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        print(f"kmgpu launch: process {j.rank} of {j.world} failed; stopping it.",
              file=sys.stderr)
        _die(1)
    return 0


def _die(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- TensorFlow / JAX: start this host's processes --------------------------------------
def spawn(args, backend):
    """Start ``nproc_per_node`` processes of the job on this host and watch them.

    Each runs ``python -m kmgpu.commands.launch script ...`` with torchrun's variables (and
    TF_CONFIG for TensorFlow). When one fails, the others here are stopped and the
    exit status is the failing one's; processes on other hosts learn it from
    their backend (a broken collective, missed heartbeats) and stop too.
    """
    n, p = args.nnodes, args.nproc_per_node
    world = n * p
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(p),
               MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port),
               GROUP_RANK=str(args.node_rank), NNODES=str(n))
    hosts = None
    if backend == "tensorflow":
        hosts = exchange_addresses(args) if n > 1 else [args.master_addr] * n
    procs = []
    for i in range(p):
        rank = args.node_rank * p + i
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(i))
        if hosts is not None:
            e["TF_CONFIG"] = tf_config(hosts, p, rank, args.master_port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kmgpu.commands.launch", args.script] + list(args.args), env=e))
    return _watch(procs, args.node_rank * p)


def _watch(procs, first_rank):
    stop = []

    def forward(signum, _frame):
        stop.append(signum)
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [pr.poll() for pr in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                if not stop:
                    print(f"kmgpu launch: process rank {first_rank + i} exited with status "
                          f"{code}; stopping the others on this host.", file=sys.stderr)
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs, grace=5.0):
    for pr in procs:
        if pr.poll() is None:
            pr.terminate()
    deadline = time.time() + grace
    for pr in procs:
        try:
            pr.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()


def exchange_addresses(args, timeout=300.0):
    """Every host's address, in node-rank order, learnt through host 0.

    TensorFlow's TF_CONFIG names every worker's address, but a host knows only its
    own and --master-addr. Host 0 listens on --master-port until every other host
    has said its node rank; the address each was seen from is its address. The
    port is free again before any worker starts.
    """
    n, deadline = args.nnodes, time.time() + timeout
    if args.node_rank == 0:
        seen = {0: args.master_addr}
        conns = []
        with socket.create_server(("", args.master_port), reuse_port=False) as server:
            server.settimeout(timeout)
            while len(seen) < n:
                conn, (addr, _) = server.accept()
                rank = int(conn.recv(64).decode())
                if rank in seen or not 0 < rank < n:
                    conn.close()
                    raise ValueError(f"kmgpu launch: two hosts say --node-rank {rank}: give "
                                     f"each host its own index 0..{n - 1}.")
                seen[rank] = addr
                conns.append(conn)
            hosts = [seen[r] for r in range(n)]
            for conn in conns:
                with conn:
                    conn.sendall(json.dumps(hosts).encode())
        return hosts
    while True:
        try:
            with socket.create_connection((args.master_addr, args.master_port), 5) as conn:
                conn.settimeout(timeout)
                conn.sendall(str(args.node_rank).encode())
                data = b""
                while not data.endswith(b"]"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                return json.loads(data.decode())
        except (ConnectionRefusedError, socket.timeout, OSError, ValueError):
            if time.time() > deadline:
                raise RuntimeError(
                    f"kmgpu launch: host 0 at {args.master_addr}:{args.master_port} did not "
                    f"answer within {timeout:.0f} s: start kmgpu launch there with "
                    "--node-rank 0 and the same --master-addr/--master-port.") from None
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())

"""kmgpu's own torch workers: a pool of one process per device, kept between calls.

``WorkerPool`` starts the workers (``worker.main``) with ``torch.multiprocessing``
(fork for CPU workers and while CUDA is not initialised here, spawn otherwise),
streams rank 0's output to ``sys.stdout`` (a Jupyter cell too), sends each call's
``messages``, and waits for the answers in a loop that also watches every worker's
liveness: a worker that dies or raises ends the call within a second, with its
traceback, and the whole pool is killed (the next call starts a fresh one). Ctrl-C
during a fit asks the workers to stop after the current step (``Interrupts``), so
the pool lives on and rank 0 hands back that step's state; a second Ctrl-C, or
Ctrl-C in another call, kills the pool (``interrupts``). The workers' output is
``outputs.RankOutputs``'s; what travels besides messages (data files, the state file)
is ``transport``'s; which pool serves an engine is ``launchers.PoolLauncher``'s.
"""

import atexit
import os
import pickle
import signal
import sys
import time
import weakref

import numpy as np

from kmgpu import environment
from kmgpu.engines.torch import transport
from kmgpu.engines.torch.launch.interrupts import Interrupts
from kmgpu.engines.torch.launch.messages import (Died, Done, Event, Exit, Failed, Pieces, Port,
                                                 Ready, TimedOut, Want)
from kmgpu.engines.torch.launch.outputs import RankOutputs


class WorkerError(RuntimeError):
    """A torch worker failed; the message holds its traceback."""


_POOLS = weakref.WeakSet()
_EXITING = False  # set at interpreter exit


def start_method(cuda_workers):
    """How to start workers: fork where safe, spawn otherwise. KMGPU_TORCH_START overrides.

    Fork is fast (no second ``import keras``) and keeps classes defined in a
    notebook. It is safe for CPU workers, and for GPU workers only while this
    process has not initialised the CUDA driver: importing Keras calls
    ``torch.cuda.is_available()``, which runs ``cuInit`` unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` was set first.
    """
    import multiprocessing

    import torch

    choice = (environment.setting("KMGPU_TORCH_START") or "").strip().lower()
    if choice in ("fork", "spawn", "forkserver"):
        return choice
    if "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if cuda_workers and (torch.cuda.is_initialized()
                         or os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1"):
        return "spawn"
    return "fork"


class _Main:
    """Spawned workers import kmgpu, not the user's ``__main__`` (a script without an
    ``if __name__ == "__main__"`` guard would otherwise run again in every worker)."""

    def __enter__(self):
        self.main = sys.modules.get("__main__")
        self.saved = {}
        for name in ("__spec__", "__file__"):
            if self.main is not None and hasattr(self.main, name):
                self.saved[name] = getattr(self.main, name)
        if self.main is not None:
            self.main.__spec__ = None
            if hasattr(self.main, "__file__"):
                del self.main.__file__

    def __exit__(self, *exc):
        if self.main is not None:
            for name, value in self.saved.items():
                setattr(self.main, name, value)
            if "__spec__" not in self.saved:
                self.main.__spec__ = None


class WorkerPool:
    """One worker process per device, in one torch.distributed group.

    The workers' stdout/stderr come through one pipe each. The calling thread
    reads them while it waits for a call (no reader threads), so rank 0's
    progress bar is written to ``sys.stdout`` from the thread that runs the call:
    in Jupyter it lands in the cell that is running, even when the pool was
    started by an earlier cell. The other ranks' output is kept (the last 8 KiB)
    for error messages.

    Args:
        devices: torch device strings, one per rank: "cpu" or "cuda:<i>".
        backend: "gloo" or "nccl".
        settings: what a worker needs before importing Keras (env, Keras config).
    """

    def __init__(self, devices, backend, settings):
        self.devices, self.backend, self.settings = list(devices), backend, dict(settings)
        self.world = len(self.devices)
        self.procs, self.conns, self._pids = [], [], []
        self.output = RankOutputs(self.world)
        self.model_key = None
        self.synced = None  # the token of the launcher whose template the replicas hold
        # the ``held_slots.HeldSlots`` whose template's optimizer slots the ranks keep
        # (``optim.held``): its ``fetch`` copies them there before the workers go (``close``)
        self.holder = None
        self.closed = False
        self._state = None  # kept between calls: its pages are mapped already
        self.method = None

    # -- start ---------------------------------------------------------------------
    def start(self, timeout=300):
        import torch.multiprocessing as tmp

        from kmgpu.engines.torch.launch import worker

        self.method = start_method(self.devices[0].startswith("cuda"))
        ctx = tmp.get_context(self.method)
        if self.method == "fork":
            import gc

            # Collect this process's garbage here, where its gloo threads exist: a forked
            # worker would inherit it (a finished in-process rank's DDP Reducer, say) and
            # could hang destroying it (the workers also gc.freeze() what they inherit).
            gc.collect()
        threads = 1  # libgomp's pool does not survive fork: one intra-op thread
        if self.method != "fork" and not self.devices[0].startswith("cuda"):
            threads = max(1, (os.cpu_count() or 1) // self.world)
        settings = dict(self.settings, threads=threads, backend=self.backend,
                        parent=os.getpid())
        _POOLS.add(self)
        try:
            for rank, device in enumerate(self.devices):
                out_r, out_w = ctx.Pipe(duplex=False)
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=worker.main, name=f"kmgpu-torch-rank{rank}",
                    args=(rank, self.world, device, child_end, out_w, settings),
                )
                if self.method == "fork":
                    proc.start()
                else:
                    with _Main():
                        proc.start()
                child_end.close()
                out_w.close()
                self.procs.append(proc)
                self._pids.append(proc.pid)
                self.conns.append(parent_end)
                self.output.pipes.append(out_r)
            # rendezvous: rank 0 hosts the TCPStore on a free loopback port
            port = self._collect_one(0, Port, timeout)
            for conn in self.conns[1:]:
                conn.send(port)
            self.gather(Ready, timeout=timeout)
        except BaseException:
            self.kill()
            raise
        return self

    @property
    def pids(self):
        return list(self._pids)

    def state_file(self, layout):
        """The pool's ``transport.StateFile`` for these arrays, its snapshots reset.

        The same file while the layout fits in it (fit's weights + optimizer
        state, predict's weights alone): its pages are mapped already.

        Args:
            layout: [(shape, dtype str), ...] of the arrays.
        """
        wanted = [(tuple(s), np.dtype(d).str) for s, d in layout]
        if self._state is None or self._state.layout != wanted:
            size = 3 * transport.StateFile(None, wanted).slot_size
            if self._state is not None and size <= os.path.getsize(self._state.path):
                self._state = transport.StateFile(self._state.path, wanted)
            else:
                self._drop_state()
                self._state = transport.StateFile.make(layout)
        self._state.reset()
        return self._state

    def _drop_state(self):
        if self._state is not None:
            path, self._state = self._state.path, None
            transport.remove(os.path.dirname(path))  # its private directory

    def alive(self):
        return not self.closed and all(p.is_alive() for p in self.procs)

    # -- calls -----------------------------------------------------------------------
    def _collect_one(self, rank, expected, timeout):
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        conn, proc = self.conns[rank], self.procs[rank]
        while True:
            ready = wait([conn, proc.sentinel] + list(self.output.open_pipes()), timeout=0.5)
            self.output.drain(ready)
            if conn in ready or conn.poll():
                msg = conn.recv()
                if isinstance(msg, expected):
                    return msg
                raise self._error({rank: msg})
            if not proc.is_alive():
                raise self._error({rank: Died(proc.exitcode)})
            if time.monotonic() > deadline:
                raise WorkerError(f"kmgpu: torch worker rank {rank} did not start within "
                                  f"{timeout} s.\n{self.output.tail(rank)}")

    def call(self, messages, on_event=None, on_interrupt=None, on_state=None):
        """Send one message per rank (a ``Call`` or a ``WeightsQuery``); return the
        ranks' answers (the ``Done`` values, rank order).

        ``on_event(Event) -> Reply`` answers rank 0's callback events while the call
        runs; ``on_state(conn, message)`` any rank's state over its pipe (``Want``,
        ``Pieces``: ``launch.state_pipe.DriverPipe``). Raises the worker's own exception (chained to a WorkerError holding its
        traceback) or WorkerError if a worker died; the pool is dead afterwards.
        With ``on_interrupt``, a first Ctrl-C calls it (the workers are asked to stop)
        and the call goes on until they answer, then KeyboardInterrupt is raised with
        the pool alive; otherwise, or on a second Ctrl-C or after ``Interrupts.GRACE``
        seconds, KeyboardInterrupt kills the pool and propagates.
        """
        ends = [e + 1 for e in self.output.ends]
        interrupts = Interrupts(on_interrupt)
        try:
            for conn, msg in zip(self.conns, messages):
                conn.send(msg)
            with interrupts:
                results = [done.value for done in
                           self.gather(Done, on_event=on_event, interrupts=interrupts,
                                       on_state=on_state)]
        except BaseException:
            self.kill()
            raise
        self.output.wait(ends)
        if interrupts.pressed:
            raise KeyboardInterrupt
        return results

    def gather(self, expected, timeout=None, on_event=None, interrupts=None, on_state=None):
        """One message of type ``expected`` from every rank (rank order), watching
        liveness; answers Events with ``on_event`` and the state over the pipes with
        ``on_state`` on the way."""
        from multiprocessing.connection import wait

        results, failures = {}, {}
        pending = set(range(self.world))
        deadline = None if timeout is None else time.monotonic() + timeout
        grace = None
        while pending:
            waitables = ([self.conns[r] for r in pending]
                         + [self.procs[r].sentinel for r in pending] + list(self.output.open_pipes()))
            ready = set(wait(waitables, timeout=0.25))
            if interrupts is not None:
                interrupts.check()
            self.output.drain(ready)
            for r in sorted(pending):
                conn, proc = self.conns[r], self.procs[r]
                msg = None
                if conn in ready or proc.sentinel in ready:
                    try:
                        if conn.poll():
                            msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is None and not proc.is_alive():
                        proc.join(1)
                        msg = Died(proc.exitcode)
                if msg is None:
                    continue
                if isinstance(msg, Event) and on_event is not None:
                    conn.send(on_event(msg))
                    continue
                if isinstance(msg, (Want, Pieces)) and on_state is not None:
                    try:
                        on_state(conn, msg)
                    except (EOFError, OSError):  # the worker died mid-transfer
                        proc.join(1)
                        msg = Died(proc.exitcode if not proc.is_alive() else None)
                    else:
                        continue
                pending.discard(r)
                if isinstance(msg, expected):
                    results[r] = msg
                else:
                    failures[r] = msg
            now = time.monotonic()
            if failures and grace is None:
                grace = now + 1.5  # let the other ranks report why they stopped
            if grace is not None and now > grace:
                break
            if deadline is not None and now > deadline:
                failures.update({r: TimedOut() for r in pending})
                break
        if failures:
            self.output.wait([e + 1 for e in self.output.ends], timeout=0.5)
            raise self._error(failures)
        return [results[r] for r in range(self.world)]

    def _error(self, failures):
        """The exception to raise for {rank: message}; the root cause first."""
        def order(item):
            rank, msg = item
            if isinstance(msg, Failed):  # a collective failing: likely another rank's fault
                return (2 if msg.collective else 0, rank)
            if isinstance(msg, Died):
                return (1, rank)
            return (3, rank)

        parts, original = [], None
        ranked = sorted(failures.items(), key=order)
        for i, (rank, msg) in enumerate(ranked):
            if isinstance(msg, Failed):
                parts.append(f"rank {rank} (pid {self._pids[rank]}) raised:\n{msg.traceback}")
                if i == 0 and order((rank, msg))[0] == 0 and msg.exception is not None:
                    try:
                        original = pickle.loads(msg.exception)
                    except Exception:
                        original = None
            elif isinstance(msg, Died):
                code = msg.exitcode
                how = (f"was killed by signal {signal.Signals(-code).name}"
                       if code is not None and code < 0 else f"exited with code {code}")
                tail = self.output.tail(rank)
                parts.append(f"rank {rank} (pid {self._pids[rank]}) {how}"
                             + (f"\n{tail}" if tail else ""))
            elif isinstance(msg, TimedOut):
                parts.append(f"rank {rank} did not answer in time")
            else:
                parts.append(f"rank {rank} sent {type(msg).__name__}")
        error = WorkerError("kmgpu: torch worker failure; all workers were stopped.\n\n"
                            + "\n\n".join(parts))
        if isinstance(original, BaseException):
            original.__cause__ = error
            return original
        return error

    # -- ending --------------------------------------------------------------------
    def close(self, timeout=10.0):
        """Ask the workers to leave the group and exit; kill what does not. What the
        ranks keep of a template's state goes to it first (``holder``), unless the
        interpreter is exiting."""
        if self.closed:
            return
        if self.holder is not None and not _EXITING:
            self.holder.fetch()  # it lets the pool go (``holder`` None)
        for conn in self.conns:
            try:
                conn.send(Exit())
            except (OSError, EOFError, BrokenPipeError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        """Stop every worker now (SIGTERM, then SIGKILL); free pipes and process handles."""
        if self.closed:
            return
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        try:
            self.output.wait([RankOutputs.CLOSED] * self.world, timeout=0.5)
        except Exception:
            pass
        for conn in self.conns + self.output.pipes:
            conn.close()
        for proc in self.procs:
            try:
                proc.close()
            except ValueError:
                pass
        self.conns, self.output.pipes = [], []
        self._drop_state()
        self.closed = True
        _POOLS.discard(self)


@atexit.register
def _close_all():
    # runs before transport's own atexit (registered first), which removes what is left
    global _EXITING
    _EXITING = True  # no model outlives the interpreter: nothing to copy back
    for pool in list(_POOLS):
        try:
            pool.close(timeout=5.0)
        except Exception:
            pass

"""kmgpu's own torch workers: a pool of one process per device, kept between calls.

Launching is kept apart from what a rank does (``_torch_rank``), as Lightning
Fabric keeps launchers apart from strategies. This module is the parent's side:

- ``WorkerPool`` starts the workers with ``torch.multiprocessing`` (fork for CPU
  workers and while CUDA is not initialised here, spawn otherwise), streams rank 0's
  output to ``sys.stdout`` (a Jupyter cell too), sends each call, and waits for
  the answers in a loop that also watches every worker's liveness: a worker that
  dies or raises ends the call within a second, with its traceback, and the whole
  pool is killed (the next call starts a fresh one). Ctrl-C kills the pool too.
- ``CallFiles`` hands a call's data to the workers once, as memory-mapped
  ``.npy`` files in ``/dev/shm`` (every worker maps the same pages; removed
  after the call). Every file kmgpu writes lives in a private directory of its
  own (``mkdtemp``: mode 0700, files 0600) named ``kmgpu-<pid>-*``; it is removed
  after the call or with the pool, at exit, by the workers when this process dies
  without exiting, and by the next kmgpu process when even they could not. The pool's ``StateFile`` (kept between calls) carries the
  weights and optimizer state in and back: rank 0 writes snapshots at epoch
  ends (always at the end, and whenever the user's callbacks need the weights),
  so an interrupted fit still leaves the last consistent state.
"""

import atexit
import codecs
import itertools
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import weakref

import numpy as np

#: written by a worker to its output pipe at the end of every call
END_MARK = b"\x1e\x1fkmgpu-call-end\x1f\x1e"
_TAIL = 8192

try:  # classes and functions defined in __main__ / a notebook travel by value
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover
    _pickler = pickle


def dumps(obj):
    return _pickler.dumps(obj)


#: what forked workers inherit instead of receiving it pickled (custom objects)
INHERITED = {"custom_objects": {}}


class WorkerError(RuntimeError):
    """A torch worker failed; the message holds its traceback."""


# -- files --------------------------------------------------------------------------
class Leaf:
    """Stands for one array in a memory-mapped file of the call directory."""

    def __init__(self, path):
        self.path = path

    def load(self):
        return np.load(self.path, mmap_mode="r")


def _shm_root(nbytes):
    root = "/dev/shm"
    try:
        if os.path.isdir(root) and shutil.disk_usage(root).free > 2 * nbytes + (64 << 20):
            return root
    except OSError:
        pass
    return tempfile.gettempdir()


def _private_dir(nbytes):
    """A new directory only this user can enter (0700), removed at the latest at exit."""
    _sweep_once()
    path = tempfile.mkdtemp(prefix=f"kmgpu-{os.getpid()}-", dir=_shm_root(nbytes))
    _LIVE_PATHS.add(path)
    return path


def _private_file(path):
    """Create ``path`` readable and writable by this user only (0600)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def remove_leftovers(pid=None):
    """Remove the ``kmgpu-<pid>-*`` entries of a process that is gone (all such
    processes with ``pid=None``) from /dev/shm and the temp dir: this user's only."""
    import re

    pattern = re.compile(r"kmgpu-(\d+)-")
    for root in {"/dev/shm", tempfile.gettempdir()}:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if not m or (pid is not None and int(m.group(1)) != pid):
                continue
            owner = int(m.group(1))
            path = os.path.join(root, name)
            try:
                if os.lstat(path).st_uid != os.getuid() or owner == os.getpid():
                    continue
                os.kill(owner, 0)
                continue  # that process is alive
            except ProcessLookupError:
                pass
            except OSError:
                continue
            _remove(path)


_SWEPT = []


def _sweep_once():
    if not _SWEPT:
        _SWEPT.append(True)
        remove_leftovers()


def _as_array(leaf):
    if leaf is None or isinstance(leaf, np.ndarray):
        return leaf
    if hasattr(leaf, "detach"):  # torch tensor
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


class CallFiles:
    """A temporary directory for one call's data arrays (removed after the call)."""

    def __init__(self, nbytes_hint=0):
        self.path = _private_dir(nbytes_hint)
        self._count = itertools.count()

    def put(self, structure):
        """Write every array leaf of ``structure`` to a file; return it with Leafs."""
        import keras

        def put_leaf(leaf):
            arr = _as_array(leaf)
            if arr is None or arr.dtype == object:
                return arr
            path = _private_file(os.path.join(self.path, f"a{next(self._count)}.npy"))
            out = np.lib.format.open_memmap(path, mode="w+", dtype=arr.dtype, shape=arr.shape)
            out[...] = arr
            out.flush()
            del out
            return Leaf(path)

        return keras.tree.map_structure(put_leaf, structure)

    def close(self):
        _remove(self.path)


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
    _LIVE_PATHS.discard(path)


def resolve(structure):
    """Replace Leafs by read-only memory maps (in a worker)."""
    import keras

    return keras.tree.map_structure(
        lambda leaf: leaf.load() if isinstance(leaf, Leaf) else leaf, structure
    )


class StateFile:
    """Weights + optimizer state in three slots of one memory-mapped file.

    Slot 0 carries the parent's state in; slots 1 and 2 take rank 0's snapshots in
    turn. A slot's header (sequence number, complete flag, epoch) is written after
    its data, so a reader never takes a half-written slot.

    Args:
        path: the file.
        layout: [(shape, dtype str), ...] of the arrays in a slot.
        create: make the file (parent) or open it (worker).
    """

    HEADER = 64

    @classmethod
    def make(cls, layout):
        """A new state file in a private directory of its own in /dev/shm (or the temp
        dir when /dev/shm is short of room)."""
        probe = cls(None, layout)
        path = _private_file(os.path.join(_private_dir(3 * probe.slot_size), "state"))
        return cls(path, layout, create=True)

    def __init__(self, path, layout, create=False):
        self.path = path
        self.layout = [(tuple(s), np.dtype(d).str) for s, d in layout]
        self.offsets, size = [], self.HEADER
        for shape, dtype in self.layout:
            self.offsets.append(size)
            size += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 64) * 64
        self.slot_size = size
        self.mm = None
        if path is not None:
            mode = "w+" if create else "r+"
            self.mm = np.memmap(path, dtype=np.uint8, mode=mode, shape=(3 * size,))

    def reset(self):
        """Mark the snapshot slots empty (a new call begins)."""
        for slot in (1, 2):
            self._header(slot)[:] = 0

    def _header(self, slot):
        return self.mm[slot * self.slot_size: slot * self.slot_size + 24].view(np.int64)

    def write(self, slot, arrays, seq=1, epoch=-1):
        arrays = list(arrays)
        if len(arrays) != len(self.layout):
            raise ValueError(f"state has {len(arrays)} arrays, the file {len(self.layout)}")
        head = self._header(slot)
        head[1] = 0
        base = slot * self.slot_size
        for arr, (shape, dtype), off in zip(arrays, self.layout, self.offsets):
            arr = np.asarray(arr)
            if tuple(arr.shape) != shape:
                raise ValueError(f"state array of shape {arr.shape}, expected {shape}")
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            self.mm[base + off: base + off + n].view(dtype).reshape(shape)[...] = arr
        head[0], head[2] = seq, epoch
        head[1] = 1

    def read(self, slot):
        head = self._header(slot)
        if head[1] != 1:
            return None
        base = slot * self.slot_size
        out = []
        for (shape, dtype), off in zip(self.layout, self.offsets):
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            out.append(np.array(self.mm[base + off: base + off + n].view(dtype).reshape(shape)))
        return out

    def latest(self):
        """(arrays, epoch) of the newest complete snapshot, or None."""
        best = None
        for slot in (1, 2):
            head = self._header(slot)
            if head[1] == 1 and (best is None or head[0] > best[1]):
                best = (slot, int(head[0]), int(head[2]))
        if best is None:
            return None
        arrays = self.read(best[0])
        return (arrays, best[2]) if arrays is not None else None

    def close(self):
        self.mm = None  # the mapping goes with its last view


# -- the pool -----------------------------------------------------------------------
_LIVE_PATHS = set()  # files and folders kmgpu made; removed at the latest at exit
_POOLS = weakref.WeakSet()


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

    choice = os.environ.get("KMGPU_TORCH_START", "").strip().lower()
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
        self.procs, self.conns, self.outs, self._pids = [], [], [], []
        self.model_key = None
        self.closed = False
        self._state = None  # kept between calls: its pages are mapped already
        self._marks = [0] * self.world
        self._tails = [bytearray() for _ in range(self.world)]
        self._pending = [b""] * self.world
        self._decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace")
                          for _ in range(self.world)]
        self.method = None

    # -- start ---------------------------------------------------------------------
    def start(self, timeout=300):
        import torch.multiprocessing as tmp

        from kmgpu.engines.torch import worker as _torch_worker

        self.method = start_method(self.devices[0].startswith("cuda"))
        ctx = tmp.get_context(self.method)
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
                    target=_torch_worker.main, name=f"kmgpu-torch-rank{rank}",
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
                self.outs.append(out_r)
            # rendezvous: rank 0 hosts the TCPStore on a free loopback port
            port = self._collect_one(0, "port", timeout)
            for conn in self.conns[1:]:
                conn.send(("port", port))
            self.gather(["ready"] * self.world, timeout=timeout)
        except BaseException:
            self.kill()
            raise
        return self

    @property
    def pids(self):
        return list(self._pids)

    def state_file(self, layout):
        """The pool's StateFile for this layout (the same file while the layout fits
        in it: fit's weights + optimizer state, predict's weights alone)."""
        wanted = [(tuple(s), np.dtype(d).str) for s, d in layout]
        if self._state is None or self._state.layout != wanted:
            size = 3 * StateFile(None, wanted).slot_size
            if self._state is not None and size <= os.path.getsize(self._state.path):
                self._state = StateFile(self._state.path, wanted)
            else:
                self._drop_state()
                self._state = StateFile.make(layout)
        self._state.reset()
        return self._state

    def _drop_state(self):
        if self._state is not None:
            path, self._state = self._state.path, None
            _remove(os.path.dirname(path))  # its private directory

    def alive(self):
        return not self.closed and all(p.is_alive() for p in self.procs)

    # -- output ----------------------------------------------------------------------
    def _read(self, rank):
        """Read what rank ``rank`` wrote (its pipe is readable); False at end of file."""
        out = self.outs[rank]
        try:
            chunk = os.read(out.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            self._marks[rank] += 1 << 30  # closed: nothing more will come
            self._emit(rank, self._pending[rank], final=True)
            self._pending[rank] = b""
            return False
        data = self._pending[rank] + chunk
        while END_MARK in data:
            before, data = data.split(END_MARK, 1)
            self._emit(rank, before)
            self._marks[rank] += 1
        keep = 0  # a marker may be split across reads
        for k in range(min(len(END_MARK) - 1, len(data)), 0, -1):
            if END_MARK.startswith(data[-k:]):
                keep = k
                break
        self._emit(rank, data[: len(data) - keep])
        self._pending[rank] = data[len(data) - keep:]
        return True

    def _emit(self, rank, data, final=False):
        if not data and not final:
            return
        tail = self._tails[rank]
        tail += data
        del tail[:-_TAIL]
        text = self._decoders[rank].decode(data, final=final)
        if rank == 0 and text:
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except Exception:  # a closed or odd stdout must not end the call
                pass

    def _open_outs(self):
        return {out: r for r, out in enumerate(self.outs) if self._marks[r] < (1 << 30)}

    def _drain(self, ready):
        outs = self._open_outs()
        for obj in ready:
            if obj in outs:
                self._read(outs[obj])

    def _wait_output(self, marks, timeout=5.0):
        """Read output until every rank has written its end-of-call marker."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while any(m < want for m, want in zip(self._marks, marks)):
            left = deadline - time.monotonic()
            outs = self._open_outs()
            if left <= 0 or not outs:
                return
            self._drain(wait(list(outs), timeout=min(left, 0.25)))

    # -- calls -----------------------------------------------------------------------
    def _collect_one(self, rank, kind, timeout):
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        conn, proc = self.conns[rank], self.procs[rank]
        while True:
            ready = wait([conn, proc.sentinel] + list(self._open_outs()), timeout=0.5)
            self._drain(ready)
            if conn in ready or conn.poll():
                msg = conn.recv()
                if msg[0] == kind:
                    return msg[1]
                raise self._error({rank: msg})
            if not proc.is_alive():
                raise self._error({rank: ("died", proc.exitcode)})
            if time.monotonic() > deadline:
                raise WorkerError(f"kmgpu: torch worker rank {rank} did not start within "
                                  f"{timeout} s.\n{self._tail(rank)}")

    def call(self, payloads, on_event=None):
        """Send one payload per rank; return the ranks' results (list).

        ``on_event(*event)`` answers rank 0's callback events while the call runs.
        Raises the worker's own exception (chained to a WorkerError holding its
        traceback) or WorkerError if a worker died; the pool is dead afterwards.
        KeyboardInterrupt (also from ``on_event``) kills the pool and propagates.
        """
        marks = [m + 1 for m in self._marks]
        try:
            for conn, payload in zip(self.conns, payloads):
                conn.send(("call", payload))
            results = self.gather(["ok"] * self.world, on_event=on_event)
        except BaseException:
            self.kill()
            raise
        self._wait_output(marks)
        return results

    def gather(self, kinds, timeout=None, on_event=None):
        """One message of the expected kind from every rank, watching liveness."""
        from multiprocessing.connection import wait

        results, failures = {}, {}
        pending = set(range(self.world))
        deadline = None if timeout is None else time.monotonic() + timeout
        grace = None
        while pending:
            waitables = ([self.conns[r] for r in pending]
                         + [self.procs[r].sentinel for r in pending] + list(self._open_outs()))
            ready = set(wait(waitables, timeout=0.25))
            self._drain(ready)
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
                        msg = ("died", proc.exitcode)
                if msg is None:
                    continue
                if msg[0] == "event" and on_event is not None:
                    conn.send(("reply", on_event(*msg[1])))
                    continue
                pending.discard(r)
                if msg[0] == kinds[r]:
                    results[r] = msg[1]
                else:
                    failures[r] = msg
            now = time.monotonic()
            if failures and grace is None:
                grace = now + 1.5  # let the other ranks report why they stopped
            if grace is not None and now > grace:
                break
            if deadline is not None and now > deadline:
                failures.update({r: ("timeout", None) for r in pending})
                break
        if failures:
            self._wait_output([m + 1 for m in self._marks], timeout=0.5)
            raise self._error(failures)
        return [results[r] for r in range(self.world)]

    def _tail(self, rank):
        text = bytes(self._tails[rank]).decode("utf-8", "replace").strip()
        return f"--- last output of rank {rank} ---\n{text}" if text else ""

    def _error(self, failures):
        """The exception to raise for {rank: message}; the root cause first."""
        def order(item):
            rank, msg = item
            if msg[0] == "error":
                return (0 if not msg[3] else 2, rank)  # msg[3]: a collective failed
            if msg[0] == "died":
                return (1, rank)
            return (3, rank)

        parts, original = [], None
        ranked = sorted(failures.items(), key=order)
        for i, (rank, msg) in enumerate(ranked):
            if msg[0] == "error":
                _, blob, tb, _ = msg
                parts.append(f"rank {rank} (pid {self._pids[rank]}) raised:\n{tb}")
                if i == 0 and order((rank, msg))[0] == 0 and blob is not None:
                    try:
                        original = pickle.loads(blob)
                    except Exception:
                        original = None
            elif msg[0] == "died":
                code = msg[1]
                how = (f"was killed by signal {signal.Signals(-code).name}"
                       if code is not None and code < 0 else f"exited with code {code}")
                tail = self._tail(rank)
                parts.append(f"rank {rank} (pid {self._pids[rank]}) {how}"
                             + (f"\n{tail}" if tail else ""))
            elif msg[0] == "timeout":
                parts.append(f"rank {rank} did not answer in time")
            else:
                parts.append(f"rank {rank} sent {msg[0]!r}")
        error = WorkerError("kmgpu: torch worker failure; all workers were stopped.\n\n"
                            + "\n\n".join(parts))
        if isinstance(original, BaseException):
            original.__cause__ = error
            return original
        return error

    # -- ending --------------------------------------------------------------------
    def close(self, timeout=10.0):
        """Ask the workers to leave the group and exit; kill what does not."""
        if self.closed:
            return
        for conn in self.conns:
            try:
                conn.send(("exit", None))
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
            self._wait_output([1 << 30] * self.world, timeout=0.5)
        except Exception:
            pass
        for conn in self.conns + self.outs:
            conn.close()
        for proc in self.procs:
            try:
                proc.close()
            except ValueError:
                pass
        self.conns, self.outs = [], []
        self._drop_state()
        self.closed = True
        _POOLS.discard(self)


@atexit.register
def _close_all():
    for pool in list(_POOLS):
        try:
            pool.close(timeout=5.0)
        except Exception:
            pass
    for path in list(_LIVE_PATHS):
        _remove(path)

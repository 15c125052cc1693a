"""How data and state reach kmgpu's torch workers: files, the state file, pickling.

- ``CallFiles`` hands a call's arrays to the workers once, as memory-mapped ``.npy``
  files in ``/dev/shm`` (every worker maps the same pages; removed after the call);
  a worker gets them back with ``resolve``.
- ``StateFile`` carries weights and optimizer state in and back where the state is not
  sharded (shard="weights" sends it over the pipes: ``launch.state_pipe``): the driver
  writes slot 0; rank 0 writes snapshots at epoch ends (``launch.snapshots``), so an
  interrupted fit still leaves the last consistent state. Its first page carries the
  driver's stop request (Ctrl-C) in every call. A slot nothing will read gives its memory back
  (``free``): an older snapshot once a newer one is complete, and every slot once the
  driver has loaded the call's state, so between calls the file holds no state.
- Every file kmgpu writes lives in a private directory of its own (``mkdtemp``: mode
  0700, files 0600) named ``kmgpu-<pid>-*``. It is removed after the call or with
  the pool, at exit, by the workers when the driver dies without exiting
  (``remove_leftovers``), and by the next kmgpu process when even they could not.
- ``dumps`` pickles by value where cloudpickle is installed (classes defined in a
  notebook); what cannot be pickled, forked workers inherit (``INHERITED``).

Files are read as raw arrays (``np.load`` without pickles); pickles travel only over
the pipes between the driver and its own workers.
"""

import atexit
import itertools
import os
import pickle
import re
import shutil
import tempfile

import numpy as np

try:  # classes and functions defined in __main__ / a notebook travel by value
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover
    _pickler = pickle

#: what forked workers inherit instead of receiving it pickled (``replicas.model_spec``)
INHERITED = {"objects": None}

_LIVE_PATHS = set()  # files and folders kmgpu made; removed at the latest at exit
_SWEPT = []


def dumps(obj):
    """Pickle ``obj`` (by value with cloudpickle where installed).

    Returns:
        bytes.
    """
    return _pickler.dumps(obj)


def as_array(leaf):
    """A data leaf as a NumPy array (torch tensors to the CPU); None stays None."""
    if leaf is None or isinstance(leaf, np.ndarray):
        return leaf
    if hasattr(leaf, "detach"):  # torch tensor
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


# -- private files ----------------------------------------------------------------------
def _shm_root(nbytes):
    root = "/dev/shm"
    try:
        if os.path.isdir(root) and shutil.disk_usage(root).free > 2 * nbytes + (64 << 20):
            return root
    except OSError:
        pass
    return tempfile.gettempdir()


def private_dir(nbytes):
    """A new directory only this user can enter (0700), removed at the latest at exit.

    Args:
        nbytes: what will be written there: /dev/shm when it has room, else the temp dir.

    Returns:
        The directory's path.
    """
    if not _SWEPT:
        _SWEPT.append(True)
        remove_leftovers()
    path = tempfile.mkdtemp(prefix=f"kmgpu-{os.getpid()}-", dir=_shm_root(nbytes))
    _LIVE_PATHS.add(path)
    return path


def private_file(path):
    """Create ``path`` readable and writable by this user only (0600); return it."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def remove(path):
    """Remove a file or directory kmgpu made (no error if it is gone)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
    _LIVE_PATHS.discard(path)


def remove_leftovers(pid=None):
    """Remove the ``kmgpu-<pid>-*`` entries of a process that is gone (all such
    processes with ``pid=None``) from /dev/shm and the temp dir: this user's only.

    Args:
        pid: the process whose entries to remove, or None for every dead one.
    """
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
            remove(path)


# -- a call's data --------------------------------------------------------------------
class Leaf:
    """Stands for one array in a memory-mapped file of the call directory."""

    def __init__(self, path):
        self.path = path

    def load(self):
        return np.load(self.path, mmap_mode="r")


class CallFiles:
    """A temporary directory for one call's data arrays (removed by ``close``).

    Args:
        nbytes_hint: about how much will be written (picks /dev/shm or the temp dir).
    """

    def __init__(self, nbytes_hint=0):
        self.path = private_dir(nbytes_hint)
        self._count = itertools.count()

    def put(self, structure):
        """Write every array leaf of ``structure`` to a file.

        Returns:
            The structure with a ``Leaf`` in place of each array.
        """
        import keras

        def put_leaf(leaf):
            arr = as_array(leaf)
            if arr is None or arr.dtype == object:
                return arr
            path = private_file(os.path.join(self.path, f"a{next(self._count)}.npy"))
            out = np.lib.format.open_memmap(path, mode="w+", dtype=arr.dtype, shape=arr.shape)
            out[...] = arr
            out.flush()
            del out
            return Leaf(path)

        return keras.tree.map_structure(put_leaf, structure)

    def close(self):
        remove(self.path)


def resolve(structure):
    """In a worker: replace each ``Leaf`` by a read-only memory map of its file."""
    import keras

    return keras.tree.map_structure(
        lambda leaf: leaf.load() if isinstance(leaf, Leaf) else leaf, structure
    )


# -- the state file -------------------------------------------------------------------
class StateFile:
    """Weights + optimizer state in three slots of one memory-mapped file.

    Slot 0 carries the driver's state in; slots 1 and 2 take the ranks' snapshots in
    turn. A slot's header (sequence number, complete flag, epoch) is written after
    its data (after every rank's, where each writes its pieces), so a reader never
    takes a half-written slot. A slot may hold only some of the arrays (``complete``'s
    ``missing``: under shard="weights" the optimizer's slots stay in the ranks); its
    mask, after the arrays, says which, and ``read`` gives None for the others. Slot 0's
    header also holds a stop request (the driver's Ctrl-C) and the step every rank stops
    before (``request_stop``, ``stop_before``).

    Args:
        path: the file (None: only compute the slot size).
        layout: [(shape, dtype str), ...] of the arrays in a slot.
        create: make the file (driver) or open it (worker).
    """

    HEADER = 64

    @classmethod
    def make(cls, layout):
        """A new state file in a private directory of its own in /dev/shm (or the temp
        dir when /dev/shm is short of room)."""
        probe = cls(None, layout)
        path = private_file(os.path.join(private_dir(3 * probe.slot_size), "state"))
        return cls(path, layout, create=True)

    def __init__(self, path, layout, create=False):
        self.path = path
        self.layout = [(tuple(s), np.dtype(d).str) for s, d in layout]
        self.offsets, size = [], self.HEADER
        for shape, dtype in self.layout:
            self.offsets.append(size)
            size += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 64) * 64
        self.mask_offset = size  # one byte per array: 1 where the slot holds it
        size += -(-len(self.layout) // 64) * 64
        self.slot_size = size
        self.mm = None
        if path is not None:
            mode = "w+" if create else "r+"
            self.mm = np.memmap(path, dtype=np.uint8, mode=mode, shape=(3 * size,))

    def reset(self):
        """Mark the snapshot slots empty and clear any stop request (a new call begins)."""
        for slot in (1, 2):
            self._header(slot)[:] = 0
        self._control()[:] = (0, -1)

    def _control(self):
        return self.mm[32:48].view(np.int64)  # slot 0's header: stop requested, stop step

    def request_stop(self):
        """The driver: ask the ranks to stop training after the current step."""
        self._control()[0] = 1

    def stop_requested(self):
        return bool(self._control()[0])

    def stop_before(self, step=None):
        """The step (counted from the fit's start) every rank stops before; -1: none.
        With ``step``, rank 0 sets it first (once)."""
        control = self._control()
        if step is not None and control[1] < 0:
            control[1] = step
        return int(control[1])

    def _header(self, slot):
        return self.mm[slot * self.slot_size: slot * self.slot_size + 24].view(np.int64)

    def write(self, slot, arrays, seq=1, epoch=-1):
        """Write ``arrays`` (matching the layout) to ``slot``, then mark it complete."""
        arrays = list(arrays)
        if len(arrays) != len(self.layout):
            raise ValueError(f"state has {len(arrays)} arrays, the file {len(self.layout)}")
        for arr, view in zip(arrays, self.begin(slot)):
            arr = np.asarray(arr)
            if tuple(arr.shape) != view.shape:
                raise ValueError(f"state array of shape {arr.shape}, expected {view.shape}")
            view[...] = arr
        self.complete(slot, seq, epoch)

    def begin(self, slot):
        """Mark ``slot`` incomplete; return writable views of its arrays (the layout's
        order) for a writer that fills them itself, then calls ``complete``."""
        self._header(slot)[1] = 0
        return self._views(slot)

    def complete(self, slot, seq=1, epoch=-1, missing=()):
        """Mark ``slot`` complete: snapshot number ``seq``, the state at ``epoch``, holding
        every array but those whose indices are in ``missing``."""
        mask = self._mask(slot)
        mask[:] = 1
        mask[list(missing)] = 0
        head = self._header(slot)
        head[0], head[2] = seq, epoch
        head[1] = 1

    def _mask(self, slot):
        start = slot * self.slot_size + self.mask_offset
        return self.mm[start: start + len(self.layout)]

    def _views(self, slot):
        base = slot * self.slot_size
        out = []
        for (shape, dtype), off in zip(self.layout, self.offsets):
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            out.append(np.asarray(self.mm[base + off: base + off + n]).view(dtype).reshape(shape))
        return out

    def write_one(self, slot, index, arr):
        """Overwrite array ``index`` of ``slot``'s complete snapshot (same shape)."""
        shape, dtype = self.layout[index]
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        base = slot * self.slot_size + self.offsets[index]
        self.mm[base: base + n].view(dtype).reshape(shape)[...] = np.asarray(arr)

    def relabel(self, slot, epoch):
        """Say that ``slot``'s complete snapshot is the state at ``epoch`` as well."""
        self._header(slot)[2] = epoch

    def read(self, slot, copy=True):
        """The arrays of ``slot`` (None for an array it does not hold), or None when it is
        not complete. ``copy=False``: views of the file, valid until the next call writes
        it (for a reader that copies them at once, e.g. into a model's variables)."""
        if self._header(slot)[1] != 1:
            return None
        views = [v if held else None for v, held in zip(self._views(slot), self._mask(slot))]
        return [v if v is None else np.array(v) for v in views] if copy else views

    def latest(self, copy=True):
        """(arrays, epoch) of the newest complete snapshot, or None (``copy``: as
        ``read``)."""
        best = None
        for slot in (1, 2):
            head = self._header(slot)
            if head[1] == 1 and (best is None or head[0] > best[1]):
                best = (slot, int(head[0]), int(head[2]))
        if best is None:
            return None
        arrays = self.read(best[0], copy=copy)
        return (arrays, best[2]) if arrays is not None else None

    def free(self, slot=None):
        """Mark ``slot`` (None: every slot) empty and give its pages back to the system:
        the file keeps its size and reads as zeros there until written again. Slot 0's
        header page stays (the stop request). Where the file system cannot punch holes,
        the pages stay."""
        page = os.sysconf("SC_PAGE_SIZE")
        slots = (0, 1, 2) if slot is None else (slot,)
        for s in slots:
            self._header(s)[1] = 0
        if slot is None:
            start, end = page, os.path.getsize(self.path)
        else:  # its header page stays: the slot's number, flag and epoch
            start = -(-(slot * self.slot_size + self.HEADER) // page) * page
            end = (slot + 1) * self.slot_size // page * page
        if end > start:
            _punch_hole(self.path, start, end - start)

    def close(self):
        self.mm = None  # the mapping goes with its last view


def _punch_hole(path, offset, length):
    """Free ``length`` bytes of ``path``'s storage from ``offset`` (Linux ``fallocate`` with
    ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``; tmpfs and the usual disk file systems).
    False where it cannot."""
    import ctypes

    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return False
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        return fallocate(fd, 0x02 | 0x01, offset, length) == 0
    finally:
        os.close(fd)


@atexit.register
def _remove_all():
    # registered before the pool's own atexit (that module imports this one), so it
    # runs after the pools have closed
    for path in list(_LIVE_PATHS):
        remove(path)

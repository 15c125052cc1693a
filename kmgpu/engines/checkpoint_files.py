"""The files of a sharded checkpoint (``kmgpu.checkpoints``, which says what it is), for the
front and the engines alike: the arrays of a model's state in their order, the data file
mapped (``Arrays``), making, completing and finding a checkpoint.

A checkpoint directory holds one folder per saved epoch (``epoch-00003``) and a file
``latest`` naming the newest complete one (replaced atomically once every writer is
done, so a process that dies while saving leaves the previous checkpoint). A folder
holds:

- ``state.bin``: every array whole at its own offset (64-byte aligned), in the order
  Keras lists them on every backend: the model's weights (``model.weights``), its
  optimizer's state (``optimizer.variables`` but the learning rate), the learning rate
  where a variable holds it. A writer maps the file and writes only its parts, so the
  file does not depend on the device count or the shard value: a checkpoint loads into
  any N.
- ``manifest.json``: each array's path, shape, dtype and offset; the epoch; the best
  value of ``monitor`` so far.
"""

import json
import os
import shutil
import sys

import numpy as np

from kmgpu.engines import replication
from kmgpu.engines.replication import numpy_dtype

FORMAT = 1
DATA, MANIFEST, LATEST = "state.bin", "manifest.json", "latest"
_ALIGN = 64


# -- the arrays of a model's state ----------------------------------------------------
def state_variables(model):
    """The variables a checkpoint holds, in its order (the optimizer built first where
    it is not yet), and (weights, optimizer state, has a learning-rate variable)
    counts."""
    variables = replication.weights(model)  # stateful RNN rows are not the model's state
    n_weights, n_optimizer, has_lr = len(variables), 0, False
    opt = getattr(model, "optimizer", None)
    if opt is not None:
        if not opt.built:
            opt.build(model.trainable_variables)
        state = replication.optimizer_state(opt)
        variables += state
        n_optimizer = len(state)
        lr = replication.lr_variable(model)
        if lr is not None:
            variables.append(lr)
            has_lr = True
    return variables, (n_weights, n_optimizer, has_lr)


def entries_of(variables):
    """Each variable's (path, shape, Keras dtype name), for a manifest."""
    return [(getattr(v, "path", v.name), tuple(int(d) for d in v.shape), str(v.dtype))
            for v in variables]


class Arrays:
    """A checkpoint's ``state.bin``: each array mapped on its own when it is used.

    ``views()`` (and ``begin``/``read``) is a sequence whose item ``i`` maps array ``i``
    afresh; the mapping goes when that view does. So a writer or reader that takes one
    array at a time holds the pages of that array only: a process's memory (its
    proportional set size counts the file pages it maps) never holds the file whole.
    ``begin``/``read`` take a slot argument so that a torch rank's writers and readers
    of a pool's state file (``replicas.write_pieces``, ``load_pieces``) work on it as
    on that file's slot 0.

    Args:
        path: the file.
        entries: [(path, shape, dtype name), ...].
        create: make the file (its size set, its pages not yet written).
        writable: open an existing file to write parts of it (another writer made it).
    """

    def __init__(self, path, entries, create=False, writable=False):
        self.path = path
        self.entries = [(p, tuple(s), d) for p, s, d in entries]
        self.offsets, size = [], 0
        for _, shape, dtype in self.entries:
            self.offsets.append(size)
            n = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
            size += -(-n // _ALIGN) * _ALIGN
        self.size = size
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        # read-only opens map copy-on-write: writable arrays (torch wants them), the file
        # left as it is
        self.mode = "r+" if create or writable else "c"

    def view(self, i):
        """Array ``i``, mapped now."""
        _, shape, dtype = self.entries[i]
        dt = numpy_dtype(dtype)
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dt)
        return np.memmap(self.path, dtype=dt, mode=self.mode, offset=self.offsets[i],
                         shape=shape)

    def views(self):
        return _Views(self)

    def begin(self, slot=0):
        return self.views()

    def read(self, slot=0, copy=False):
        return [np.array(self.view(i)) for i in range(len(self.entries))] if copy \
            else self.views()

    def flush(self):
        """What the writers wrote, on disk."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Views:
    """``Arrays.views()``: a sequence of the arrays, each mapped when it is taken."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays.entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.arrays.view(k) for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.arrays.view(i)


# -- the directory --------------------------------------------------------------------
def folder_for(directory, epoch):
    return os.path.join(os.fspath(directory), f"epoch-{epoch:05d}")


def create(directory, epoch, entries):
    """A new folder for ``epoch``'s checkpoint, its data file sized, nothing written yet
    (a folder of that name left by a save that did not finish is replaced).

    Returns:
        The folder and its ``Arrays`` (writable).
    """
    folder = folder_for(directory, epoch)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    return folder, Arrays(os.path.join(folder, DATA), entries, create=True)


def finish(directory, folder, arrays, counts, epoch, extra=None, keep=1):
    """Complete a checkpoint once every writer has written its parts: the data flushed,
    the manifest written, ``latest`` pointed at it (atomically), then all but the newest
    ``keep`` folders removed."""
    arrays.flush()
    n_weights, n_optimizer, has_lr = counts
    manifest = {"format": FORMAT, "epoch": int(epoch), "n_weights": n_weights,
                "n_optimizer": n_optimizer, "has_lr": bool(has_lr),
                "arrays": [{"path": p, "shape": list(s), "dtype": d, "offset": o}
                           for (p, s, d), o in zip(arrays.entries, arrays.offsets)]}
    manifest.update(extra or {})
    _write_atomic(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))
    _write_atomic(os.path.join(os.fspath(directory), LATEST), os.path.basename(folder))
    folders = sorted(f for f in os.listdir(directory) if f.startswith("epoch-"))
    newest = os.path.basename(folder)
    for old in [f for f in folders if f != newest][:max(0, len(folders) - keep)]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def _write_atomic(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest(directory):
    """(folder, manifest) of ``directory``'s newest complete checkpoint, or None."""
    pointer = os.path.join(os.fspath(directory), LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        folder = os.path.join(os.fspath(directory), f.read().strip())
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"kmgpu: {folder} is a checkpoint of format "
                         f"{manifest.get('format')}; this kmgpu reads format {FORMAT}")
    return folder, manifest


def open_arrays(folder, manifest):
    """The ``Arrays`` of a complete checkpoint, read-only."""
    entries = [(a["path"], tuple(a["shape"]), a["dtype"]) for a in manifest["arrays"]]
    return Arrays(os.path.join(folder, DATA), entries)


def check_matches(manifest, variables, counts, where):
    """Raise a ValueError that says what differs when the checkpoint's arrays are not
    ``variables``' (the same count of weights and optimizer variables, and shapes).
    ``counts``: (weights, optimizer variables) of ``variables``; with optimizer None,
    ``variables`` are the weights alone, matched against the checkpoint's weights."""
    arrays = manifest["arrays"]
    got = (manifest["n_weights"], manifest["n_optimizer"])
    if counts[1] is None:
        counts, arrays = (counts[0], got[1]), arrays[:got[0]]
    if got != tuple(counts[:2]) or len(arrays) != len(variables):
        raise ValueError(
            f"kmgpu: the checkpoint in {where} holds {got[0]} weights and {got[1]} "
            f"optimizer variables; this model has {counts[0]} and {counts[1]}. Restore it "
            "into the model (and optimizer) it was saved from, or pass resume=False.")
    for a, v in zip(arrays, variables):
        if tuple(a["shape"]) != tuple(v.shape):
            raise ValueError(
                f"kmgpu: the checkpoint in {where} holds {a['path']} of shape "
                f"{tuple(a['shape'])}; this model's {getattr(v, 'path', v.name)} has shape "
                f"{tuple(v.shape)}. Restore it into the model it was saved from.")


# -- the host's random states ---------------------------------------------------------
def host_random_state():
    """The host random states Keras's shuffles draw from (``replication.host_random_state``:
    NumPy's global generator for the batches of arrays on JAX, Python's ``random`` for a
    PyDataset's order, torch's default CPU generator for torch's data loaders), for a
    manifest. A fit resumed with them draws the orders the uninterrupted fit drew.
    TensorFlow's ``tf.data`` shuffles draw from the graph's own generators, which this
    leaves out."""
    (version, internal, py_gauss), (name, keys, pos, has_gauss, gauss), torch_state = \
        replication.host_random_state()
    state = {"numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "python": [version, list(internal), py_gauss]}
    if torch_state is not None:
        state["torch"] = torch_state.numpy().tobytes().hex()
    return state


def set_host_random_state(state):
    """Put back what ``host_random_state`` gave (None: nothing; torch's state where
    both the manifest and this process have torch)."""
    if not state:
        return
    name, keys, pos, has_gauss, gauss = state["numpy"]
    version, internal, py_gauss = state["python"]
    torch = sys.modules.get("torch")
    torch_state = None
    if torch is not None and "torch" in state:
        torch_state = torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8)
    replication.set_host_random_state(
        ((version, tuple(internal), py_gauss),
         (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss), torch_state))

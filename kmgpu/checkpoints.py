"""Sharded checkpoints: a fit's state saved without gathering it, resumed from on any N.

``ShardedCheckpoint`` is a Keras callback, for every backend and every ``shard`` value. At
an epoch end it saves the weights, the optimizer state and the learning rate; at the start
of a fit it restores the newest checkpoint and the fit continues from the epoch after it,
as ``BackupAndRestore`` does. Where the state lives in pieces, each piece is written
where it is: under shard="weights" each torch rank writes its own pieces, and a JAX
array each device's shard; no process gathers the state. ``load`` puts a checkpoint into
a model (plain Keras: for ``model.save`` or ``save_weights``), one array at a time;
``export`` writes Keras's own ``.weights.h5`` (or sharded weights files) from it, streamed,
without loading the state into the model.

The files (one folder per saved epoch, every array whole at its own offset, so a
checkpoint does not depend on the device count): ``engines.checkpoint_files``. Under the
torch engine's worker ranks the callback asks and the ranks save and restore
(``engines.torch.launch.checkpoint_io``); elsewhere it reads and writes the model that
trains, in this process.
"""

import os

import numpy as np

from kmgpu.engines import replication
from kmgpu.engines.checkpoint_files import (DATA, LATEST, Arrays, check_matches, create,
                                            entries_of, finish, folder_for,
                                            host_random_state, latest, open_arrays,
                                            set_host_random_state, state_variables)

__all__ = ["ShardedCheckpoint", "load", "export", "save", "latest"]


# -- a model in this process ----------------------------------------------------------
def write_value(variable, view, whole=True):
    """``variable``'s value into ``view``: a sharded JAX array shard by shard (each
    device's own, one writer per shard), anything else whole (a ``tf.distribute``
    variable: its first replica's copy) where ``whole``."""
    value = variable.value
    shards = getattr(value, "addressable_shards", None)
    if shards is not None and not getattr(value, "is_fully_replicated", True):
        for shard in shards:
            if shard.replica_id == 0:
                view[shard.index] = np.asarray(shard.data)
    elif whole:
        view[...] = np.asarray(variable.numpy())


def read_value(variable, view):
    """``view`` into ``variable``: a sharded JAX variable takes each device's slice only."""
    value = variable.value
    sharding = getattr(value, "sharding", None)
    if sharding is not None and not getattr(value, "is_fully_replicated", True):
        import jax

        variable.assign(jax.make_array_from_callback(
            tuple(view.shape), sharding, lambda index: np.asarray(view[index])))
        return
    variable.assign(np.asarray(view))


def save(model, directory, epoch, extra=None, keep=1):
    """``model``'s state (in this process) as ``directory``'s checkpoint of ``epoch``.

    In a job of several processes (``kmgpu launch``) under JAX every process writes its
    devices' shards (the directory must be one every host sees), process 0 makes the
    file first and completes the checkpoint last; under TensorFlow, whose replicas hold
    the state whole, process 0 alone writes it."""
    from kmgpu import environment

    index, count = environment.process_index(), environment.process_count()
    every = count > 1 and _jax()
    if index != 0 and not every:
        return
    variables, counts = state_variables(model)
    entries = entries_of(variables)
    folder = folder_for(directory, epoch)
    if index == 0:
        folder, arrays = create(directory, epoch, entries)
    if every:
        _barrier("kmgpu-checkpoint-made")
        if index != 0:
            arrays = Arrays(os.path.join(folder, DATA), entries, writable=True)
    for i, v in enumerate(variables):  # one array mapped at a time
        write_value(v, arrays.view(i), whole=index == 0)
    if every:
        arrays.flush()
        _barrier("kmgpu-checkpoint-written")
    if index == 0:
        finish(directory, folder, arrays, counts, epoch, extra, keep)


def _jax():
    import keras

    return keras.backend.backend() == "jax"


def _barrier(name):
    """Every process of a JAX job reaches this point before any goes on."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def load(directory, model, optimizer=True):
    """Put ``directory``'s newest checkpoint into ``model``: its weights and, with
    ``optimizer``, its optimizer's state and learning rate (the optimizer built first).
    Each array is copied once from the mapped file into its variable. Then
    ``model.save("model.keras")`` or ``model.save_weights(...)`` exports it as plain
    Keras.

    Returns:
        The checkpoint's epoch.
    """
    folder, manifest, variables = _matched(directory, model, optimizer)
    _read_into(variables, folder, manifest)
    return manifest["epoch"]


def _matched(directory, model, optimizer):
    """(folder, manifest) of ``directory``'s newest checkpoint and the variables of
    ``model`` its arrays go to (with ``optimizer`` and an optimizer, its state and
    learning rate too), checked to match."""
    found = latest(directory)
    if found is None:
        raise FileNotFoundError(f"kmgpu: no checkpoint in {directory} (no '{LATEST}' file)")
    folder, manifest = found
    if optimizer and getattr(model, "optimizer", None) is not None:
        variables, counts = state_variables(model)
    else:
        variables = replication.weights(model)
        counts = (len(variables), None)
    check_matches(manifest, variables, counts, folder)
    return folder, manifest, variables


def export(directory, model, path, optimizer=True, max_shard_size=None):
    """Write ``directory``'s newest checkpoint as Keras's own weights file,
    ``model.save_weights(path, max_shard_size=...)``'s format (``.weights.h5``, or Keras's
    sharded weights with ``max_shard_size``), streamed: each array is mapped from the
    checkpoint only while Keras writes it, so neither ``model`` nor this process holds
    the state whole on its way, and ``model`` is left as it was. ``model`` (the
    architecture the checkpoint was saved from) gives the file its layout; with
    ``optimizer`` and a compiled ``model``, its optimizer's state goes in too (the
    optimizer built first where it is not yet: Keras's walk writes only the variables
    that exist). ``keras.Model.load_weights(path)`` reads the file back.

    Returns:
        The checkpoint's epoch.
    """
    import keras

    from kmgpu.engines import model_fixes

    folder, manifest, variables = _matched(directory, model, optimizer)
    arrays = open_arrays(folder, manifest)
    index = {id(v): i for i, v in enumerate(variables)}
    written = set()

    def value_of(variable):
        i = index.get(id(variable))
        if i is None:
            return None
        written.add(i)
        view = arrays.view(i)
        if view.dtype.kind == "V":  # raw bytes of a dtype NumPy lacks (bfloat16)
            import ml_dtypes

            view = view.view(getattr(ml_dtypes, keras.backend.standardize_dtype(
                variable.dtype)))
        return view

    model_fixes.save_weights_from(model, path, value_of, max_shard_size)
    left = [getattr(variables[i], "path", variables[i].name)
            for i in range(len(variables)) if i not in written]
    if left:  # a layer's own save_own_variables wrote values, not its variables
        raise ValueError(
            f"kmgpu: {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} went into {path} "
            "from the model, not from the checkpoint: a layer saves them itself. Use "
            "kmgpu.checkpoints.load(directory, model), then model.save_weights(path).")
    return manifest["epoch"]


def _read_into(variables, folder, manifest):
    """The checkpoint's first ``len(variables)`` arrays into ``variables``, one array
    mapped at a time."""
    arrays = open_arrays(folder, manifest)
    for i, v in enumerate(variables):
        read_value(v, arrays.view(i))


# -- the callback ---------------------------------------------------------------------
def _callback_base():
    import keras

    return keras.callbacks.Callback


class ShardedCheckpoint(_callback_base()):
    """Save the fit's whole state at epoch ends, each piece where it lives; resume from it.

    At the start of a fit (``resume``), the newest checkpoint in ``directory`` is restored
    into what trains (weights, optimizer state, learning rate) and the fit continues from
    the epoch after it, as after ``keras.callbacks.BackupAndRestore``: an interrupted run
    started again with the same call ends as the uninterrupted one would. A checkpoint
    stays after the fit (a next fit with the same callback resumes from it; pass
    ``resume=False`` or another directory to start over). ``kmgpu.checkpoints.load``
    puts one into a plain Keras model.

    Args:
        directory: where the checkpoints go (made where missing).
        monitor, mode, save_best_only: as ``keras.callbacks.ModelCheckpoint``'s: with
            ``save_best_only`` an epoch is saved only when ``monitor`` improved.
        resume: restore the newest checkpoint at the start of each fit.
        keep: how many of the newest checkpoints stay.
    """

    # the torch engine's workers save and restore the state (``requests``): on its
    # driver this callback reads and sets no weights
    _kmgpu_weight_free = True
    _kmgpu_sharded_checkpoint = True  # what the torch engine's relay looks for

    def __init__(self, directory, monitor="val_loss", mode="auto", save_best_only=False,
                 resume=True, keep=1):
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"kmgpu: ShardedCheckpoint mode {mode!r}: pass 'auto', 'min' "
                             "or 'max'")
        if int(keep) < 1:
            raise ValueError(f"kmgpu: ShardedCheckpoint keep={keep}: keep at least 1")
        # absolute: the torch engine's ranks work in other directories
        self.directory = os.path.abspath(os.fspath(directory))
        self.monitor, self.mode = monitor, mode
        self.save_best_only, self.resume, self.keep = save_best_only, resume, int(keep)
        self.best = None
        # set by an engine whose workers hold the state: ("save"|"restore", folder or
        # directory, extra) tuples the workers carry out at this hook
        self.requests = None

    def _better(self, value):
        mode = self.mode
        if mode == "auto":
            name = self.monitor.lower()
            mode = "max" if any(k in name for k in ("acc", "auc", "precision", "recall",
                                                    "f1")) else "min"
        if self.best is None:
            return True
        return value > self.best if mode == "max" else value < self.best

    def on_train_begin(self, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        found = latest(self.directory) if self.resume else None
        if found is None:
            return
        folder, manifest = found
        self.best = manifest.get("best")
        if self.requests is not None:
            # the workers restore it; a checkpoint of another model is refused here
            # first, before any of them reads it (the optimizer, not yet built in this
            # process, is checked by the workers)
            weights = replication.weights(self.model)
            check_matches(manifest, weights, (len(weights), None), folder)
            self.requests.append(("restore", folder, manifest))
        else:
            variables, counts = state_variables(self.model)
            check_matches(manifest, variables, counts, folder)
            _read_into(variables, folder, manifest)
            set_host_random_state(manifest.get("random"))
        self.model._initial_epoch = manifest["epoch"] + 1

    def on_epoch_end(self, epoch, logs=None):
        if self.save_best_only:
            value = (logs or {}).get(self.monitor)
            if value is None:
                import warnings

                warnings.warn(f"kmgpu: ShardedCheckpoint monitors {self.monitor!r}, which "
                              f"the logs lack (they have {sorted(logs or {})}): not saved",
                              stacklevel=2)
                return
            if not self._better(float(value)):
                return
            self.best = float(value)
        extra = {"best": self.best, "monitor": self.monitor}
        if self.requests is not None:  # rank 0 adds its random states (it draws the orders)
            self.requests.append(("save", folder_for(self.directory, epoch),
                                  dict(extra, epoch=epoch, keep=self.keep)))
        else:
            save(self.model, self.directory, epoch, dict(extra, random=host_random_state()),
                 self.keep)

"""The Keras-patch registry of what every backend shares, and the one way kmgpu changes
Keras for a block (``swapped``) or for good (``install``).

Every backend package has a ``keras_fixes.py`` with the same two tables, and nothing else:

- ``PATCHES``: each Keras internal kmgpu replaces, wraps or calls, one row each:
  (Keras module, attribute (dotted within the module), the kmgpu function that does it
  (a module of the package, ``role_fixes.function``, or a whole ``kmgpu.`` path), what
  Keras does there and why kmgpu does not leave it so).
- ``READS``: private Keras attributes kmgpu only reads (or sets as Keras itself does):
  (module, attribute, what for).
- ``KERAS``: the Keras releases the rows were checked against, as pyproject.toml's
  ``dependencies`` give them (``kmgpu.versions`` warns once outside it). Where releases
  differ, the row (or a comment above the table) says which and how it is handled.

The code is in the role modules beside each table, named alike where the role is the
same: here ``loss_fixes`` (each replica's part of the loss), ``model_fixes`` (the model's
kind, what travels beside its config and weights, saving) and ``data_fixes`` (Python
data); in a backend package ``step_fixes``, ``data_fixes``, ``layer_fixes``,
``optimizer_fixes`` and torch's ``capture_fixes``, ``cond_fixes``, ``fast_fixes``.
``tests/unit/test_patches.py`` checks every row against the installed Keras, and fails
when kmgpu touches a private Keras attribute that no table lists.
"""

import threading
import types
import weakref

KERAS = ">=3.14,<3.16"

#: (module, attribute (dotted within the module), by, why)
PATCHES = [
    ("keras.src.saving.saving_lib", "get_attr_skipset", "model_fixes.warm_saving",
     "saving's skip-set cache is stored as saving_attr_skipset_* but read as "
     "saving_attr_skiplist_* (Keras 3.15.1 saving_lib), so every save makes throw-away "
     "objects (a variable among them, which process 0 alone would make inside fit: a "
     "collective the others never enter); every process warms the cache under the name "
     "Keras reads"),
    ("keras.src.backend.common.global_state", "set_global_attribute",
     "model_fixes.warm_saving", "where that cache lives"),
    ("keras.src.saving.serialization_lib", "tf", "model_fixes.serialize_without_tensorflow",
     "installed for good: serializing any object asks whether TensorFlow is available to "
     "test for its TensorShape and DType, which imports it, with its start-up lines, into "
     "a JAX or torch process whose plain fit never does"),
    ("keras.src.models.functional", "Functional", "model_fixes.is_functional",
     "no public class tells a functional model from a subclassed one"),
    ("keras.src.saving.saving_lib", "_save_state", "model_fixes.own_state",
     "a replica is made from the template's config, which leaves out what Keras's saving "
     "path carries beside it (each layer's save_own_variables and its load_own_variables, "
     "which finalizes adapted layers; lookup vocabularies): that walk, with an in-memory "
     "store, carries it"),
    ("keras.src.saving.saving_lib", "_load_state", "model_fixes.load_own_state", "same"),
    ("keras.src.saving.saving_lib", "NpzIOStore", "model_fixes.own_state",
     "same: the store class _load_state accepts"),
    ("keras.src.saving.saving_lib", "_save_assets_to_dict", "model_fixes.own_state",
     "same, for assets (vocabularies)"),
    ("keras.src.saving.saving_lib", "_load_assets_from_dict", "model_fixes.load_own_state",
     "same"),
    ("keras.src.saving.saving_lib", "H5IOStore", "model_fixes.save_weights_from",
     "swapped while save_weights runs, for a subclass that writes each variable's array "
     "from a checkpoint's file as Keras's walk reaches it: Keras writes a variable's own "
     "value, so an export would first load the whole state into the model"),
    ("keras.src.saving.saving_lib", "ShardedH5IOStore", "model_fixes.save_weights_from",
     "same, for save_weights(max_shard_size=...)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.save_own_variables",
     "model_fixes.save_weights_from",
     "same: the optimizer hands the store each variable's value (variable.numpy()), not "
     "the variable, as a layer does; swapped for one that hands the variables"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.exclude_from_weight_decay",
     "model_fixes.optimizer_settings",
     "it keeps var_list (as _var_key ids) and var_names (as a compiled pattern) in "
     "private attributes, _exclude_from_weight_decay and "
     "_exclude_from_weight_decay_pattern, not in get_config(), so an optimizer made from "
     "its config decays every variable; apply_optimizer_settings sets them on the replica's"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._use_weight_decay",
     "model_fixes.optimizer_settings", "same: what reads them"),
    ("keras.src.trainers.trainer", "Trainer.compute_loss", "loss_fixes.replica_loss",
     "compared with the model's own: replica_loss computes Keras's own compute_loss in its "
     "two parts (the compiled loss, the model's own losses), which weigh differently over "
     "replicas unless both are means over rows"),
    ("keras.src.trainers.trainer", "Trainer._compute_loss", "loss_fixes.replica_loss",
     "same: a model's own compute_loss, called as Keras's steps call it"),
    ("keras.src.trainers.trainer", "Trainer._aggregate_additional_loss",
     "loss_fixes.replica_loss", "same: the model's own losses, as Keras adds them"),
    ("keras.src.losses.loss", "reduce_weighted_values", "loss_fixes.masked_losses",
     "wrapped for good: a masked loss is divided by its valid entries (or their sample "
     "weights) in the replica's rows; one device divides by those of the whole batch, so "
     "within replica_loss the replica's value is reweighted by its part of them (Keras's "
     "own outside replica_loss)"),
    ("keras.src.losses.loss", "apply_mask", "loss_fixes.masked_losses",
     "same: how Keras merges mask and sample weight"),
    ("keras.src.losses.loss", "squeeze_or_expand_to_same_rank", "loss_fixes.masked_losses",
     "same"),
    ("keras.src.trainers.compile_utils", "CompileLoss.metrics",
     "loss_fixes.replica_loss",
     "each output's loss tracker, whose update_state is wrapped on the replica's (for the "
     "object's life) to take the replica's own value of that output's loss rescaled, so "
     "that the replicas add up to one device's"),
    ("keras.src.metrics.reduction_metrics", "Mean.update_state", "loss_fixes.replica_loss",
     "what is wrapped on each of those trackers"),
    ("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDatasetAdapter._get_iterator",
     "data_fixes.py_dataset_pass",
     "reads a PyDataset (workers, shuffling, class weights) for a per-replica feed"),
    ("keras.src.trainers.data_adapters.data_adapter_utils", "class_weight_to_sample_weights",
     "data_fixes.standardize_batch", "class weights of a generator fed per replica"),
]

#: (module, attribute, what for): private Keras attributes kmgpu reads, or sets as Keras does
READS = [
    ("keras.src.layers.layer", "Layer._flatten_layers",
     "a model's layers, nested ones included (no public walk)"),
    ("keras.src.layers.layer", "Layer._called",
     "replication.identity: set by Layer.__call__, left out of a layer's settings"),
    ("keras.src.layers.layer", "Layer._parent_path",
     "replication.identity: set by Layer.__call__, left out of a layer's settings"),
    ("keras.src.layers.layer", "Layer._losses",
     "global_losses: the losses a layer's call added, read and cleared per replica"),
    ("keras.src.trainers.trainer", "Trainer._compile_loss",
     "the compiled loss: whether there is one, its per-output trackers"),
    ("keras.src.trainers.trainer", "Trainer._compile_config",
     "replication, user_objects: the template's compile() arguments, to compile replicas"),
    ("keras.src.layers.layer", "Layer._metrics",
     "model_fixes: the metrics a model tracks, left out of the state it carries"),
    ("keras.src.trainers.trainer", "Trainer._loss_tracker",
     "the loss tracker kmgpu's steps update, as Keras's own steps do"),
    ("keras.src.layers.layer", "Layer._call_has_training_arg",
     "kmgpu's steps: whether to pass training=, as Keras's own steps do"),
    ("keras.src.layers.normalization.batch_normalization",
     "BatchNormalization._reduction_axes",
     "the axes BatchNorm reduces over (the engines' global-batch moments)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._learning_rate",
     "lr, replication: the learning rate or schedule as given (a variable or a schedule)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._var_key",
     "model_fixes.optimizer_settings: how it keys the variables excluded from weight decay"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._exclude_from_weight_decay",
     "model_fixes.optimizer_settings (see PATCHES)"),
    ("keras.src.optimizers.base_optimizer",
     "BaseOptimizer._exclude_from_weight_decay_pattern",
     "model_fixes.optimizer_settings: read, and set on a replica's optimizer"),
    ("keras.src.trainers.trainer", "Trainer._initial_epoch",
     "checkpoints.ShardedCheckpoint: the epoch fit resumes from, set as Keras's "
     "BackupAndRestore sets it"),
]


# -- the one way kmgpu changes Keras -----------------------------------------------------
_LOCK = threading.RLock()  # every swap, every restore and every install takes it
_ACTIVE = {}  # (id(owner), name) -> [owner, value before, blocks open, inherited]
_INSTALLED = weakref.WeakKeyDictionary()  # owner -> the keys installed on it


def swapped(*swaps):
    """Within the block, each ``(owner, name, make)`` of ``swaps`` (a Keras module, class
    or function, an attribute name, a function) has ``owner.<name>`` replaced by
    ``make(value before)``; when the block ends, the value before comes back.

    The locking rule, the same for every swap and ``install``: the attributes change, and
    their counts, under one lock, all of a block's together; the block runs without it.
    Re-entrant: a block that finds an attribute already swapped (a nested block, or one
    on another thread) leaves the replacement in place (the outer block's) and adds to
    its count; the last block to end puts the value before back. A class attribute the
    class inherited is deleted again rather than set.
    """
    return _Swapped(swaps)


class _Swapped:
    """The context of ``swapped`` (a class, not a generator: kmgpu's torch step enters a
    few of them at every step)."""

    __slots__ = ("swaps", "keys")

    def __init__(self, swaps):
        self.swaps, self.keys = swaps, None

    def __enter__(self):
        with _LOCK:
            fresh = []
            for owner, name, make in self.swaps:
                if (id(owner), name) not in _ACTIVE:
                    before = getattr(owner, name)
                    fresh.append((owner, name, before, make(before)))
            for owner, name, before, value in fresh:  # every make ran: nothing half-done
                inherited = isinstance(owner, type) and name not in vars(owner)
                _ACTIVE[(id(owner), name)] = [owner, before, 0, inherited]
                setattr(owner, name, value)
            self.keys = [(id(owner), name) for owner, name, _ in self.swaps]
            for key in self.keys:
                _ACTIVE[key][2] += 1
        return self

    def __exit__(self, *exc):
        with _LOCK:
            for key in reversed(self.keys):
                entry = _ACTIVE[key]
                entry[2] -= 1
                if entry[2] == 0:
                    del _ACTIVE[key]
                    owner, before, _, inherited = entry
                    if inherited:
                        delattr(owner, key[1])
                    else:
                        setattr(owner, key[1], before)
        return False


def install(owner, name, make, key=None):
    """Replace ``owner.<name>`` by ``make(current value)`` for good: a module's or a
    class's attribute for the process, an object's (a replica's layer, model, optimizer,
    metric) for that object's life, set with ``object.__setattr__`` so that Keras's
    attribute tracking (which wraps a list in its own) stays out of it. Under the lock
    of ``swapped``. With ``key``, once per ``owner`` and key: a later call with the
    same key leaves the first install as it is.

    Returns:
        False when ``key`` was installed on ``owner`` before, else True.
    """
    with _LOCK:
        done = _INSTALLED.setdefault(owner, set()) if key is not None else None
        if done is not None and key in done:
            return False
        value = make(getattr(owner, name))
        if isinstance(owner, (type, types.ModuleType)):
            setattr(owner, name, value)
        else:
            object.__setattr__(owner, name, value)
        if done is not None:
            done.add(key)
        return True

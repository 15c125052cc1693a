"""The user's model (the template) and its torch replicas: what must travel between them.

``replication`` copies state between two models in one process; a pool worker's
replica lives in another process, so here the same things become data:

- ``replica_key``: whether a rank's cached replica still matches the template;
- ``model_spec`` / ``FromSpec``: the model as config (with the user's lambdas), its
  compile recipe and custom objects pickled by value, on the driver; the source a worker's replica is made from
  (``replication.make_replica``, as every engine's);
- ``state_of`` / ``model_arrays`` / ``load_arrays``: weights, optimizer state and
  learning rate as one flat list of arrays (the ``transport.StateFile``'s slots);
- ``states_of`` / ``states_back``: stateful RNN rows, all B in the template, B/N
  per rank.
"""

import contextlib
import json
import pickle

import keras
import numpy as np

from kmgpu.engines import replication, user_objects
from kmgpu.engines.torch import transport
from kmgpu.engines.torch.launch.messages import ModelSpec, StateLayout
from kmgpu.engines.torch.optim import held


def replica_key(template, sync_batchnorm, lr_scale):
    """What a rank's cached replica must match to be reused for ``template``.

    ``replication.identity`` (as every engine), plus what a torch replica is built with
    (sync BatchNorm, LR scaling), the model's class and its compile config: a pool
    outlives the template and serves every ParallelModel on its devices, so an
    optimizer's ``id()`` may come back for another model.

    Returns:
        A picklable, comparable key.
    """
    compiled = (json.dumps(template.get_compile_config(), sort_keys=True, default=repr)
                if template.compiled else None)
    cls = f"{type(template).__module__}.{type(template).__qualname__}"
    return (replication.identity(template), cls, compiled, bool(sync_batchnorm), tuple(lr_scale))


# -- the model as config, with the user's objects --------------------------------------
def model_spec(template):
    """The template as a ``ModelSpec`` for the workers: its config with the user's own
    lambdas in place (``user_objects.live_config``), and beside it, pickled by value,
    the custom objects and the compile recipe (the user's losses themselves, each
    metric's settings: ``user_objects.compile_recipe``).

    What cannot be pickled (a class defined inside a function, or in a notebook
    without cloudpickle) is left in ``transport.INHERITED``: only workers forked after
    this call have it.

    Returns:
        (ModelSpec, whether the workers must inherit the objects).
    """
    serialized = keras.saving.serialize_keras_object(template)
    serialized.pop("compile_config", None)
    config, live = user_objects.live_config(template, serialized)
    custom = {**user_objects.custom_objects(template), **live}
    with keras.saving.custom_object_scope(custom):
        recipe = user_objects.compile_recipe(template) if template.compiled else None
    objects = {"custom": custom, "compile": recipe}
    try:
        blob = transport.dumps(objects)
        _loads_keeping_classes(blob, custom)
    except Exception:
        blob = None
    spec = ModelSpec(config=config, build_config=template.get_build_config(),
                     objects=blob, carried=replication.carried(template))
    if blob is None:
        transport.INHERITED["objects"] = objects
    return spec, blob is None


def _loads_keeping_classes(blob, custom):
    """``pickle.loads(blob)``, the check that the workers can load it, with the user's
    classes among ``custom`` left as they are: cloudpickle loads a class it pickled by
    value (one defined in a function or a notebook) into that same class in this
    process, resetting its methods to copies whose globals are copies (a script's
    counter would stop counting)."""
    saved = [(cls, dict(vars(cls))) for cls in custom.values() if isinstance(cls, type)]
    try:
        pickle.loads(blob)
    finally:
        for cls, attributes in saved:
            for name, value in attributes.items():
                if vars(cls).get(name) is not value:
                    try:
                        setattr(cls, name, value)
                    except (AttributeError, TypeError):  # __dict__, __weakref__
                        pass


def unpicklable(objects):
    """The names of the custom objects, losses and metrics in ``model_spec``'s objects
    that cannot be pickled, for an error message."""
    names = []
    leaves = list(objects["custom"].items())
    for key, value in (objects["compile"] or {}).items():
        leaves += [(f"compile {key}", leaf) for leaf in keras.tree.flatten(value)]
    for name, obj in leaves:
        try:
            pickle.loads(transport.dumps(obj))
        except Exception:
            if isinstance(obj, user_objects.Shared):
                obj = obj.obj  # the user's loss
            names.append(f"{name} ({getattr(obj, '__qualname__', type(obj).__name__)})")
    return names


class FromSpec:
    """In a worker: a ModelSpec as the source ``replication.make_replica`` makes this
    rank's replica from (``replication.FromTemplate`` says what a source holds).

    Args:
        spec: the ModelSpec (``model_spec``).
        unfilled: the trainable weights made without memory (``optim.unfilled``: their
            values come from the state file next), unless a layer's own state is
            loaded into it (``replication.load_carried``).
    """

    def __init__(self, spec, unfilled=False):
        self.spec, self.carried = spec, spec.carried
        self.unfilled = unfilled and (spec.carried is None or spec.carried[0] is None)
        if spec.objects is not None:
            self.objects = pickle.loads(spec.objects)
        else:  # they could not be pickled: this worker was forked after they existed
            self.objects = transport.INHERITED["objects"]
        self.compiled = self.objects["compile"] is not None

    def model(self, rows):
        """The model from its config, uncompiled; for a stateful RNN model built for B
        rows, rebuilt for ``rows(B)``, this rank's."""
        from kmgpu.engines.torch.optim import unfilled

        spec = self.spec
        empty = (unfilled.unfilled(unfilled.trainable_float) if self.unfilled
                 else contextlib.nullcontext())
        with keras.saving.custom_object_scope(self.objects["custom"]):
            with empty:
                replica = keras.saving.deserialize_keras_object(spec.config)
                if not replica.built and spec.build_config:
                    replica.build_from_config(spec.build_config)
            replication.load_carried(replica, spec.carried)
            fixed = replication.fixed_batch(replica)
            if fixed is not None:
                replica = replication.clone_at(replica, rows(fixed))
        return replica

    def compile_args(self):
        with keras.saving.custom_object_scope(self.objects["custom"]):
            return user_objects.compile_args(self.objects["compile"])


# -- weights, optimizer state, learning rate as arrays ----------------------------------
def state_of(model, with_optimizer):
    """``model``'s state as arrays, and their layout (``layout_of``).

    Args:
        model: a built model (its optimizer is built here when it is not yet).
        with_optimizer: include the optimizer's state and learning rate.

    Returns:
        (StateLayout, list of arrays).
    """
    layout = layout_of(model, with_optimizer)
    return layout, model_arrays(model, layout)


def layout_of(model, with_optimizer):
    """The layout of ``model``'s state (the weights, and with ``with_optimizer`` the
    optimizer's state and learning rate, its optimizer built first where it is not yet),
    from the variables' shapes and dtypes: no copy of the state (``write_state`` copies
    each variable straight into the file)."""
    opt = getattr(model, "optimizer", None)
    n_opt, has_lr = 0, False
    if with_optimizer and opt is not None:
        if not opt.built:
            opt.build(model.trainable_variables)
        n_opt = len(replication.optimizer_state(opt))
        has_lr = replication.lr_variable(model) is not None
    layout = StateLayout((), len(model.weights), n_opt, has_lr)
    arrays = tuple((tuple(v.shape), replication.numpy_dtype(v.dtype).str)
                   for v in transfer_variables(model, layout))
    return StateLayout(arrays, layout.n_weights, n_opt, has_lr)


def model_arrays(model, layout):
    """``model``'s weights (+ optimizer state and learning rate, as ``layout`` says)."""
    return [np.asarray(v.numpy()) for v in transfer_variables(model, layout)]


def transfer_variables(model, layout):
    """The Keras variables whose values ``layout``'s arrays are, in its order: the weights,
    the optimizer state, the learning rate (what travels between the driver and a worker;
    ``replication.state_variables`` are the stateful RNN rows, which travel apart)."""
    variables = list(model.weights)
    if layout.n_optimizer:
        variables += list(replication.optimizer_state(model.optimizer))
    if layout.has_lr:
        variables.append(model.optimizer._learning_rate)
    return variables


def _as_torch(array):
    """A torch tensor sharing ``array``'s memory, or None (a dtype torch lacks, e.g.
    ml_dtypes' bfloat16: those take Keras's own conversion)."""
    import torch

    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError):
        return None


def write_state(state, slot, model, layout, seq=1, epoch=-1, zeros_out=False):
    """``model``'s state into ``slot`` of the ``transport.StateFile``, then marked complete.

    Each variable's tensor is copied once, straight into the file (``get_weights``
    would first copy it into a new array: 400 MB of fresh pages per call for a 34M
    model with Adam). ``zeros_out``: an optimizer variable that is all zeros (a new
    optimizer's slots) is left out, the slot marked without it; a rank reads it as
    zeros (``load_arrays``' ``absent_zero``, ``load_pieces``).

    Returns:
        The optimizer variables left out.
    """
    variables = transfer_variables(model, layout)
    views = state.begin(slot)
    if len(variables) != len(views):
        raise ValueError(f"state has {len(variables)} arrays, the file {len(views)}")
    out = set(zero_slots(model, layout)[0]) if zeros_out else set()
    for i, (v, view) in enumerate(zip(variables, views)):
        if i not in out:
            _copy_out(v, view)
    state.complete(slot, seq, epoch, sorted(out))
    return [variables[i] for i in sorted(out)]


def zero_slots(model, layout):
    """The optimizer variables of ``layout`` that are all zeros (a new optimizer's
    slots, not its counters), which need not travel: (their indices, the variables)."""
    variables = transfer_variables(model, layout)
    nw = layout.n_weights
    out = [i for i in range(nw, nw + layout.n_optimizer)
           if variables[i].value.is_floating_point() and not variables[i].value.any()]
    return tuple(out), [variables[i] for i in out]


def _copy_out(variable, view):
    """``variable``'s value into ``view`` (of the state file), copied once."""
    import torch

    if tuple(variable.shape) != view.shape:
        raise ValueError(f"state array of shape {tuple(variable.shape)}, expected {view.shape}")
    dest, value = _as_torch(view), variable.value
    if dest is not None and dest.dtype == value.dtype:
        with torch.no_grad():
            dest.copy_(value)
    else:
        view[...] = _file_dtype(keras.ops.convert_to_numpy(value), view.dtype)


def _file_dtype(array, dtype):
    """``array`` as the file holds it: a dtype numpy itself lacks (ml_dtypes' bfloat16)
    is stored as raw bytes (``'<V2'``) and read back as the variable's dtype."""
    if array.dtype != dtype and np.dtype(dtype).kind == "V":
        return array.view(dtype)
    return array


def copy_in(variable, array):
    """``variable.assign(array)`` without Keras's extra copy of the array (``copy_``
    from a tensor sharing the array's memory, as Keras's torch assign does)."""
    import torch

    src, value = _as_torch(array), variable.value
    if src is None or src.dtype != value.dtype or tuple(src.shape) != tuple(value.shape):
        if np.asarray(array).dtype.kind == "V":  # raw bytes of a dtype numpy lacks
            array = np.asarray(array).view(replication.numpy_dtype(variable.dtype))
        variable.assign(array)
        return
    with torch.no_grad():
        value.copy_(src)


def load_arrays(model, arrays, layout, absent_zero=False):
    """Set ``model``'s weights (+ optimizer state and learning rate) from ``arrays``.

    The optimizer is built first when it is not yet; its state is left alone when
    its variables do not match (another optimizer). The arrays may be views of the
    state file: each is copied once, straight into its variable. An optimizer array
    that is None (a snapshot without the slots the ranks keep: ``write_pieces``) leaves
    its variable as it is, or with ``absent_zero`` (slot 0 without a new optimizer's
    zeros: ``write_state``) sets it to zeros.

    Returns:
        The optimizer variables whose arrays were None (the caller holds them:
        ``launch.held_slots``).
    """
    nw, no = layout.n_weights, layout.n_optimizer
    weights, missing = model.weights, []
    if any(a is None for a in arrays[:nw]):
        raise ValueError("kmgpu: a snapshot without the model's weights")
    if len(weights) != nw or any(tuple(v.shape) != tuple(np.shape(a))
                                 for v, a in zip(weights, arrays)):
        model.set_weights(arrays[:nw])  # Keras's own error
    for v, a in zip(weights, arrays[:nw]):
        copy_in(v, a)
    opt = getattr(model, "optimizer", None)
    if no and opt is not None:
        if not opt.built:
            opt.build(model.trainable_variables)
        variables = replication.optimizer_state(opt)
        given = arrays[nw:nw + no]
        if [tuple(v.shape) for v in variables] == [
                tuple(v.shape) if a is None else tuple(a.shape) for v, a in zip(variables, given)]:
            for v, a in zip(variables, given):
                if a is not None:
                    copy_in(v, a)
                elif absent_zero:
                    v.assign(keras.ops.zeros(v.shape, v.dtype))
            missing = [v for v, a in zip(variables, given) if a is None and not absent_zero]
    if layout.has_lr and opt is not None:
        opt._learning_rate.assign(arrays[-1])
    return missing


def load_pieces(model, arrays, layout, zero):
    """``load_arrays`` for a replica whose trainable weights and optimizer slots ``zero``
    (a ``zero.Shards`` with weights) holds in pieces: those take only this rank's pieces
    of their arrays (``piece_state.take``: slices of the state file's views, so no rank
    reads or copies the whole state), every other variable its array whole. An array
    the file does not hold (None: ``write_state``'s ``zeros_out``) is zeros.

    Returns:
        False, loading nothing, when the arrays do not match the model's variables
        (``load_arrays`` then says why, or leaves another optimizer's state alone).
    """
    from kmgpu.engines.torch.optim import piece_state, placement

    variables = transfer_variables(model, layout)
    if arrays is None or len(variables) != len(arrays) or any(
            a is not None and tuple(v.shape) != tuple(np.shape(a))
            for v, a in zip(variables, arrays)):
        return False
    # by index, each view taken where it is read (as ``write_pieces``)
    index = {id(v): i for i, v in enumerate(variables)}

    def source(v):
        a = arrays[index[id(v)]] if id(v) in index else None
        return None if a is None else _host_tensor(a, v.value.dtype)

    piece_state.take(zero, source)
    held = placement.sharded_ids(zero)
    for i, v in enumerate(variables):
        if id(v) not in held:
            a = arrays[i]
            copy_in(v, a) if a is not None else v.assign(keras.ops.zeros(v.shape, v.dtype))
    return True


def write_pieces(state, slot, model, layout, zero, rank, slots=True, indices=None):
    """``write_state`` on every rank of a replica whose trainable weights and optimizer
    slots ``zero`` holds in pieces: each rank writes its own pieces of them, rank 0
    every other variable whole (``pieces_out``). Each rank marks ``slot`` incomplete
    before it writes; the caller marks it complete once every rank has written
    (``StateFile.complete``).

    Returns:
        The indices of the layout's arrays not written (the same on every rank), for
        ``StateFile.complete``'s ``missing``.
    """
    views = state.begin(slot)
    if len(layout.arrays) != len(views):
        raise ValueError(f"state has {len(layout.arrays)} arrays, the file {len(views)}")
    found, missing = pieces_out(model, layout, zero, rank, slots, indices)
    for i, lo, hi, tensor in found:
        # a view is taken where it is written and let go after (a checkpoint's ``Arrays``
        # maps each array then, so a rank never maps all its pages at once)
        _host_tensor(views[i], tensor.dtype).reshape(-1)[lo:hi].copy_(tensor)
    return missing


def pieces_out(model, layout, zero, rank, slots=True, indices=None):
    """What this rank sends of ``model``'s state (``layout``'s arrays), where ``zero`` (a
    ``zero.Shards`` with weights) holds the trainable weights and optimizer slots in
    pieces: its own pieces of those (``piece_state.spans``), and on rank 0 every other
    variable whole (``zero`` None: a replica that holds nothing in pieces, rank 0 all).

    ``slots=False`` leaves out the optimizer's slots held in pieces (they stay in the
    ranks: 8 of the 12 bytes per parameter with Adam); ``indices`` sends only those of
    the layout's arrays.

    Returns:
        ([(array index, start, stop, tensor)], the flat elements ``[start, stop)`` of
        that array), the indices of the arrays no rank sends (the same on every rank).
    """
    from kmgpu.engines.torch.optim import piece_state, placement

    variables = transfer_variables(model, layout)
    if len(variables) != len(layout.arrays):
        raise ValueError(f"state has {len(variables)} arrays, the layout {len(layout.arrays)}")
    held = placement.sharded_ids(zero) if zero is not None else set()
    kept = {id(v) for v in variables[layout.n_weights:] if id(v) in held}
    index = {id(v): i for i, v in enumerate(variables)
             if (i in indices if indices is not None else slots or id(v) not in kept)}
    found = []
    if zero is not None:
        found += [(index[id(v)], lo, hi, own) for v, lo, hi, own in piece_state.spans(zero)
                  if id(v) in index]
    if rank == 0:
        found += [(i, 0, int(v.value.numel()), v.value.detach().reshape(-1))
                  for i, v in enumerate(variables) if id(v) not in held and id(v) in index]
    return found, [i for i, v in enumerate(variables) if id(v) not in index]


def _host_tensor(array, dtype):
    """A torch tensor of ``dtype`` sharing ``array``'s memory (raw bytes of a dtype numpy
    lacks, as the state file stores ml_dtypes' bfloat16, are viewed as ``dtype``)."""
    import torch

    t = _as_torch(array)
    if t is None:
        t = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).view(dtype)
    return t


def state_versions(model):
    """What tells whether ``model``'s state changed later: each weight's and optimizer
    variable's tensor with its ``_version`` (torch bumps it at every in-place change;
    a new tensor is another object)."""
    variables = list(model.weights)
    opt = getattr(model, "optimizer", None)
    if opt is not None and opt.built:
        variables += list(opt.variables)
    return [(t, t._version) for t in (held.raw(v) for v in variables)]


def unchanged(model, old):
    """True when ``model``'s state is still what ``state_versions`` saw (same tensors, versions)."""
    new = state_versions(model)
    return len(new) == len(old) and all(
        a is b and va == vb for (a, va), (b, vb) in zip(new, old))


# -- stateful RNN rows ------------------------------------------------------------------
def states_of(template):
    """The template's stateful RNN states, all B rows each (empty list: none)."""
    return [keras.ops.convert_to_numpy(v.value) for v in replication.state_variables(template)]


def states_back(template, rows):
    """Put every rank's stateful RNN rows, in rank order, into the template.

    Args:
        template: the user's model.
        rows: per rank, the list of its state arrays (B/N rows each).
    """
    for i, v in enumerate(replication.state_variables(template)):
        v.assign(np.concatenate([r[i] for r in rows]))

"""Keras's ``cond`` as a device select while kmgpu's torch step runs: the optimizer in
graph B (LossScaleOptimizer, gradient accumulation, EMA) and whatever else branches on a
tensor in a train, test or predict step (the hinge losses and metrics' label check).
Rows of ``kmgpu/engines/torch/keras_fixes.py``.
"""

import contextlib

from kmgpu.engines import keras_fixes

#: the state of each open block, innermost last: a list of variables, or a callable that
#: makes it at the block's first cond
_STATES = []


def _device_cond(original, pred, true_fn, false_fn):
    """Keras's ``cond`` inside ``device_conditions`` / ``step_conditions``: both branches
    run from the same state, the taken one's writes are kept (``torch.where``), nothing
    read on the host. Only the state tensors a branch writes are copied and selected
    (``_Writes``): the LossScaleOptimizer's inner cond touches two scalars, not the whole
    optimizer state. The branches run in the caller's grad mode (a loss's cond is
    differentiated through the select); a branch that raises (say, a shape only the other
    branch's data has) leaves the state as it was and Keras's own cond decides."""
    import keras
    import torch

    state = _STATES[-1] if _STATES else None
    if state is None or not torch.is_tensor(pred) or pred.numel() != 1 or \
            pred.device.type == "meta":
        return original(pred, true_fn, false_fn)
    if callable(state):
        state = _STATES[-1] = list(state())
    taken = pred.reshape(()).to(torch.bool)
    values = [v.value for v in state]
    true_writes = false_writes = None
    try:
        with _Writes(values) as true_writes:
            out_true = true_fn()
        keys = sorted(true_writes.before)
        with torch.no_grad():
            after_true = dict(zip(keys, _copies([values[k] for k in keys])))
            _copy_into([values[k] for k in keys], [true_writes.before[k] for k in keys])
        with _Writes(values) as false_writes:
            out_false = false_fn()
    except Exception:
        with torch.no_grad():
            for writes in (false_writes, true_writes):  # undo, latest first
                for k, before in (writes.before.items() if writes is not None else ()):
                    values[k].copy_(before)
        return original(pred, true_fn, false_fn)
    with torch.no_grad():
        for k in sorted(set(keys) | set(false_writes.before)):
            a = after_true[k] if k in after_true else false_writes.before[k]
            values[k].copy_(torch.where(taken, a, values[k]))
    if out_true is None and out_false is None:
        return None
    return keras.tree.map_structure(lambda a, b: torch.where(taken, a, b), out_true, out_false)


def _written_tensors(func, args, kwargs):
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        yield from (value if isinstance(value, (list, tuple)) else [value])


def _Writes(values):
    """A dispatch mode that keeps a copy of each tensor of ``values`` (by storage) as it
    was before its first write in the block (``.before``: index -> copy)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    where = {t.untyped_storage().data_ptr(): i for i, t in enumerate(values)}

    class Writes(TorchDispatchMode):
        before = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for t in _written_tensors(func, args, kwargs):
                if isinstance(t, torch.Tensor):
                    k = where.get(t.untyped_storage().data_ptr())
                    if k is not None and k not in self.before:
                        self.before[k] = values[k].clone()
            return func(*args, **kwargs)

    mode = Writes()
    mode.before = {}
    return mode


def _copies(tensors):
    """Copies of ``tensors`` (multi-tensor copy kernels: a few launches, not one each)."""
    import torch

    out = [torch.empty_like(t) for t in tensors]
    _copy_into(out, tensors)
    return out


def _copy_into(dst, src):
    import torch

    if dst and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


def _selecting(original):
    """Keras's torch ``cond`` (``original``) as ``_device_cond``."""
    def cond(pred, true_fn, false_fn):
        return _device_cond(original, pred, true_fn, false_fn)
    return cond


@contextlib.contextmanager
def _conditions(variables):
    """The block of ``device_conditions`` / ``step_conditions``: ``cond`` swapped
    (re-entrant); the innermost block's state is the one a cond selects, the outer one's
    comes back as it ends. ``variables``: a list, or a callable that makes it at the
    first cond (a step without one pays nothing)."""
    from keras.src.backend.torch import core

    with keras_fixes.swapped((core, "cond", _selecting)):
        _STATES.append(variables if callable(variables) else list(variables))
        try:
            yield
        finally:
            _STATES.pop()


def optimizer_state(optimizer, trainable):
    """The variables an optimizer's ``apply`` may change: ``trainable`` and the
    optimizer's own (a LossScaleOptimizer's and its inner optimizer's)."""
    seen, out = set(), []
    opt = optimizer
    while opt is not None:
        for v in list(getattr(opt, "variables", [])):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        opt = getattr(opt, "inner_optimizer", None)
    return [v for v in trainable if id(v) not in seen] + out


def device_conditions(optimizer, trainable):
    """Within the block, Keras's torch ``cond`` (``ops.cond``) selects on the device:
    both branches run from the same state of ``optimizer_state`` and the taken one is
    kept, so a LossScaleOptimizer's finite check, ``gradient_accumulation_steps`` and
    EMA overwrites need no host read and graph B captures whole. Exact (a select)."""
    return _conditions(optimizer_state(optimizer, trainable))


def step_state(model):
    """Every variable a step of ``model`` may write: the model's, its metrics' and its
    optimizer's (once built)."""
    seen, out = set(), []
    groups = [model.variables] + [m.variables for m in model.metrics]
    if model.optimizer is not None and model.optimizer.built:
        groups.append(optimizer_state(model.optimizer, []))
    for group in groups:
        for v in group:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def step_conditions(model):
    """Within the block (a kmgpu train, test or predict step), Keras's torch ``cond``
    selects on the device as in ``device_conditions``, its state every variable of
    ``step_state(model)``, listed at the first cond of the block."""
    return _conditions(lambda: step_state(model))

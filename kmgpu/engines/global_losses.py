"""A model's own losses (``add_loss``) computed on the global batch, on TensorFlow and torch.

On one device a layer's ``add_loss`` sees the whole batch; a replica's layer sees only its
rows, so a loss that is not a mean over rows (a sum, a batch statistic, a pairwise term, a
branch on the data's values) adds up over the replicas to something other than one
device's loss. kmgpu runs such a layer on the global batch instead, and every replica
weighs the global batch's loss by its share of the rows (``loss_fixes.replica_loss``):
the parts add up to one device's loss and gradient on every batch.

``install`` wraps ``call`` of every layer written outside Keras. Inside a step of several
replicas (``on_global``, given a ``Batch``), a layer whose first call added a loss runs
from then on with its inputs gathered from every replica (``Batch.gather``, a
differentiable all-gather) and its outputs cut back to the replica's rows
(``Batch.mine``); an activity regularizer other than Keras's means over rows does alike
(``_GlobalRegularizer``). Such a layer costs its run on the whole global batch and one
all-gather of its inputs per step; what cannot run so is refused at its first step
(``_may_gather``). JAX needs none of this: one jit runs over the sharded global batch.
"""

import contextlib
import threading
import weakref

_NOW = threading.local()  # TensorFlow's replicas trace their steps in threads
_FOUND = weakref.WeakSet()  # the layers that run on the global batch


@contextlib.contextmanager
def on_global(batch):
    """Within the block (a replica's forward pass in a train or test step), the
    wrapped layers that add losses run on the global batch through ``batch`` (a
    ``Batch``; None: on the replica's rows, as Keras does)."""
    before = getattr(_NOW, "batch", None)
    _NOW.batch = batch
    try:
        yield
    finally:
        _NOW.batch = before


class Batch:
    """How one replica's step reaches the global batch; each engine makes its own.

    ``gather(t)``: ``t`` (this replica's rows first) as the global batch's, in the
    replicas' order, with the gradient described in the module. ``mine(t)``: this
    replica's rows of the global-batch tensor ``t``. ``is_local(t)`` / ``is_global(t)``:
    whether a tensor has this replica's rows / the global batch's rows in its first
    axis (which call arguments are gathered, which outputs cut).
    """

    #: why no layer may run on the global batch in this step (None: they may); a layer
    #: found adding a loss then stops the step with it
    refuse = None
    #: a train step's (True) or a test step's (False)
    training = True

    def gather(self, t):
        raise NotImplementedError

    def mine(self, t):
        raise NotImplementedError

    def is_local(self, t):
        raise NotImplementedError

    def is_global(self, t):
        raise NotImplementedError


def needs_wrapping(layer):
    """True for a layer whose ``call`` is written outside Keras: only such code calls
    ``add_loss`` in ways Keras's own layers do not (theirs: activity regularizers,
    which Keras divides by the batch size, a mean over rows)."""
    return not type(layer).__module__.startswith("keras.")


def install(model):
    """Wrap ``call`` of every layer of ``model`` (a replica) written outside Keras, the
    model itself included, and every activity regularizer that is not one of Keras's
    sums over the entries (``L1``, ``L2``, ``L1L2``; Keras divides it by the batch
    size, a mean over rows): a regularizer written outside them runs on the global
    batch's outputs (``_GlobalRegularizer``). Instance attributes: the classes are
    untouched."""
    import keras

    sums = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
    for layer in model._flatten_layers(include_self=True):
        if needs_wrapping(layer) and not getattr(layer.call, "_kmgpu_global", False):
            _wrap(layer)
        regularizer = getattr(layer, "activity_regularizer", None)
        if regularizer is not None and type(regularizer) not in sums \
                and not isinstance(regularizer, _GlobalRegularizer):
            object.__setattr__(layer, "activity_regularizer", _GlobalRegularizer(regularizer))


class _GlobalRegularizer:
    """An activity regularizer computed on the global batch's outputs inside a step:
    Keras divides its value by the replica's rows, so it returns the global value times
    ``rows here / global rows`` (the replica then holds the global value over the global
    batch's rows, one device's, and weighs it by its share)."""

    def __init__(self, regularizer):
        self.regularizer = regularizer

    def __call__(self, output):
        import keras

        batch = getattr(_NOW, "batch", None)
        if batch is None or not _tensor(output) or not batch.is_local(output):
            return self.regularizer(output)
        everyone = batch.gather(output)
        value = self.regularizer(everyone)
        here = keras.ops.cast(keras.ops.shape(output)[0], value.dtype)
        return value * here / keras.ops.cast(keras.ops.shape(everyone)[0], value.dtype)


def gathered(model):
    """The names of ``model``'s layers that run on the global batch (found so far); no
    walk over the layers while no layer of the process does (one GPU: every step)."""
    if not _FOUND:
        return []
    return [layer.name for layer in model._flatten_layers(include_self=True)
            if getattr(layer.call, "_kmgpu_global", None) is not None
            and layer.call._kmgpu_global["on"]]


def _wrap(layer):
    """Wrap ``layer.call`` (the module says how). Its first call in a train step, and its
    first in a test step, run on the replica's rows: a call that added no loss leaves
    the layer so in that kind of step, and a later call there that adds one is refused
    (the replicas decided on their own rows, and may have decided otherwise). A call
    that added one has its variables' updates undone (a layer that updates a variable
    in ``call`` updates it once per step, on the global batch, as on one device)."""
    original = layer.call
    found = {"on": False, "none": set()}  # on: runs on the global batch; none: the kinds
    # of step (training or not) whose first call added no loss

    def call(*args, **kwargs):
        batch = getattr(_NOW, "batch", None)
        if batch is None:
            return original(*args, **kwargs)
        if found["on"]:
            return _on_global_batch(batch, original, args, kwargs)
        losses, first = layer._losses, batch.training not in found["none"]
        before = len(losses)
        saved = _values(layer) if first else None
        out = original(*args, **kwargs)  # wrapped layers inside: their own check
        if len(losses) == before:
            found["none"].add(batch.training)
            return out
        if not first:
            raise NotImplementedError(
                f"kmgpu: layer {layer.name!r} added a loss (add_loss) in a "
                f"{'train' if batch.training else 'test'} step after one where it added "
                "none: it decides in Python whether to add one (by the data's values, or "
                "by a setting changed during training). kmgpu runs a layer that adds a loss "
                "on the global batch from its first call on, and the replicas, each on its "
                "own rows, may not agree to start now. Add the loss on every call (times a "
                "weight that is 0 until it applies, or chosen with keras.ops.where), or use "
                "the JAX backend.")
        del losses[before:]  # of this replica's rows only: computed again below
        for variable, value in saved:
            variable.assign(value)
        _may_gather(layer, batch)
        found["on"] = True
        _FOUND.add(layer)
        return _on_global_batch(batch, original, args, kwargs)

    call._kmgpu_global = found
    object.__setattr__(layer, "call", call)


def _values(layer):
    """(variable, a copy of its value) for ``layer``'s non-trainable variables (what a
    call may update: moving statistics, counters, random seeds)."""
    import keras

    return [(v, keras.ops.copy(v.value)) for v in layer.non_trainable_variables]


def _may_gather(layer, batch):
    """Refuse a layer that adds a loss but cannot run on the global batch."""
    import keras

    if batch.refuse:
        raise NotImplementedError(f"kmgpu: layer {layer.name!r} adds a loss (add_loss) "
                                  f"and {batch.refuse}")
    stateful = [inner.name for inner in layer._flatten_layers(include_self=True)
                if isinstance(inner, keras.layers.RNN) and inner.stateful]
    if stateful:
        raise NotImplementedError(
            f"kmgpu: layer {layer.name!r} adds a loss (add_loss) and holds the stateful "
            f"RNN layer(s) {stateful}. kmgpu runs a layer that adds a loss on the global "
            "batch so that the loss is one device's, but each replica keeps only its own "
            "rows of a stateful RNN's states. Call add_loss in a layer of its own after "
            "the RNN (on its outputs), or use the JAX backend (it computes the loss on "
            "the global batch).")


def _on_global_batch(batch, original, args, kwargs):
    import keras

    def up(t):
        return batch.gather(t) if _tensor(t) and batch.is_local(t) else t

    def down(t):
        return batch.mine(t) if _tensor(t) and batch.is_global(t) else t

    args, kwargs = keras.tree.map_structure(up, (args, kwargs))
    with on_global(None):  # the layers inside see the global batch as it is
        out = original(*args, **kwargs)
    return keras.tree.map_structure(down, out)


def _tensor(t):
    import keras

    return t is not None and keras.ops.is_tensor(t) and len(t.shape) >= 1

"""shard="weights" in a pool: a rank's replica made without memory for what it shards.

A pool rank's replica always takes its state from the state file right after it is
made (``launch.snapshots.SlotZero``: a new replica means a new model, whose state the
driver sends), so the values its variables are made with are never read. Within
``unfilled`` the Keras variables ``select`` picks (the trainable weights as the model is
built from its config, the optimizer's slots as it is built) get a tensor of their shape
and dtype whose memory is freed at once (``fsdp.free``): no initializer runs, no whole
copy is made. ``zero.Shards`` then lays them out without reading them (their pieces
start at zero) and the state file fills the pieces (``piece_state.take``). ``fill_rest``
gives memory back to any other variable left so (a frozen layer's weights), zeroed,
before anything reads it. The initial values are the user's model's, as before: parity
with one device holds exactly.
"""

import torch

from kmgpu.engines.torch.optim import fsdp


def trainable_float(variable):
    """The model's trainable floating-point weights (what ``zero.Shards`` holds)."""
    return variable.trainable and "float" in str(variable.dtype)


def float_tensor(variable):
    """A non-scalar floating-point variable (an optimizer slot; not the learning rate,
    not the iteration count)."""
    return len(variable.shape) > 0 and "float" in str(variable.dtype)


def unfilled(select):
    """Within the block, a Keras variable made from an initializer that ``select(variable)``
    picks holds no memory (its initializer is not run: ``layer_fixes.unfilled_variables``)."""
    from kmgpu.engines.torch import layer_fixes

    return layer_fixes.unfilled_variables(select)


def is_unfilled(variable):
    """True for a variable whose tensor holds no memory while it has elements."""
    value = variable.value
    return value.numel() > 0 and fsdp.is_free(value)


@torch.no_grad()
def fill_rest(variables, held):
    """Every one of ``variables`` left without memory and not in ``held`` (ids) gets its
    memory back, zeroed."""
    for v in variables:
        if id(v) not in held and is_unfilled(v):
            fsdp.grow(v.value)
            v.value.zero_()

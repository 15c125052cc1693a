"""shard="weights" on torch: where a rank's replica lives before its pieces do.

A rank builds its replica in host memory (``DDPStrategy.building``): the weights and the
optimizer state are cut into per-layer pieces there and only this rank's pieces are
copied to its device (``onto_device``), so a model too large for one device is sharded
onto the devices without a whole copy on any of them. A pool rank makes the trainable
weights and the optimizer's slots without memory at all (``unfilled``: the state file
fills the pieces next), so it holds no whole copy in host memory either. Everything else of the replica
(statistics, counters, the learning rate, metrics, random seeds, stateful RNN rows) is
moved to the device whole, one variable at a time, as it is small.

A call's state reaches the pieces (``receive``) in a pool straight from the state file:
each rank copies only the slices of slot 0 that its pieces hold (``piece_state.take``
from views of the memory-mapped file), no collective, no whole copy. Under torchrun each
process loads its own model's state into host buffers laid out as the layers
(``zero.Shards.receivable``) and rank 0's is sent piece by piece, each rank only its own
(``zero.Shards.take``).
"""

import contextlib

import torch

from kmgpu.engines import replication
from kmgpu.engines.torch import collectives
from kmgpu.engines.torch.optim import unfilled


def sharded_ids(zero):
    """The ids of the Keras variables ``zero`` holds in pieces: the trainable variables
    and their optimizer slots."""
    return {id(v) for v in zero.flat.variables} | {
        id(v) for slots in zero.flat.keras_slots.values() for v in slots}


def onto_device(strategy, replica):
    """A replica built in host memory (``strategy.host_built``): its optimizer built
    there, its trainable variables and their slots cut into pieces (``SplitStep.layout``:
    the pieces on the device, the variables views of freed device buffers), and every
    other variable moved to the device, one at a time."""
    opt = getattr(replica, "optimizer", None)
    step = strategy.sharded_step
    if step is not None and step.shard == "weights":
        if not opt.built:  # in host memory, as the weights; without memory as they
            empty = any(unfilled.is_unfilled(v) for v in replica.trainable_variables)
            with unfilled.unfilled(unfilled.float_tensor) if empty else contextlib.nullcontext():
                opt.build(replica.trainable_variables)
        step.device = strategy.device
        step.layout()
    zero = strategy._weight_shards()
    sharded = sharded_ids(zero) if zero is not None else set()
    variables = (list(replica.variables) + list(replica.metrics_variables)
                 + list(replication.state_variables(replica)))
    if opt is not None:
        variables += list(opt.variables)
    unfilled.fill_rest(variables, sharded)  # what was made without memory, not in pieces
    with torch.no_grad():
        for v in variables:
            value = v.value
            if id(v) not in sharded and value.device != strategy.device:
                value.data = value.data.to(strategy.device)


def receive(strategy, replica, load, shared):
    """``DDPStrategy.receive_state`` (its docstring says what). A pool's ``load`` that
    can fill the pieces itself (``load.pieces(replica, zero)``: from the state file)
    reads only this rank's pieces of the sharded state."""
    zero = strategy._weight_shards()
    pieces = getattr(load, "pieces", None)
    if zero is not None and shared and pieces is not None and pieces(replica, zero):
        return
    strategy.receivable()  # a sharded state's variables whole again, before ``load``
    if zero is None:
        if load is not None and (not shared or strategy.rank == 0):
            load(replica)
        strategy.broadcast_state(replica)
        return
    if load is not None:
        load(replica)
    zero.take(scatter=not shared)
    if not shared:  # what is not sharded: whole from rank 0, as unsharded
        sharded = sharded_ids(zero)
        variables = list(replica.weights) + list(replica.optimizer.variables)
        collectives.broadcast_tensors([v.value for v in variables if id(v) not in sharded],
                                      strategy.device)

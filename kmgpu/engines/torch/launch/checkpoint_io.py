"""A ``kmgpu.checkpoints.ShardedCheckpoint``'s saves and restores, on the ranks.

The callback runs on the driver with the user's model, which holds no current state
during a fit; it asks (``messages.Reply.checkpoints``) and every rank carries it out at
the same hook:

- save: rank 0 makes the checkpoint's data file, every rank writes into it what it
  holds (shard="weights" in a pool: its own pieces, ``replicas.write_pieces``; else
  rank 0 the whole state, which the sharded optimizer's gather at each epoch end has
  put in its variables), and rank 0 completes the checkpoint once all have written.
  Nothing is gathered that the fit does not gather anyway.
- restore: the checkpoint's arrays into every rank's replica as a state the driver sent
  (``snapshots.SlotZero`` over the checkpoint's file): in a pool each rank reads only its
  pieces of a sharded state; under torchrun rank 0 reads it and sends it (its file need
  not be on the other hosts).
"""

import os

from kmgpu.engines import checkpoint_files
from kmgpu.engines.torch import replicas
from kmgpu.engines.torch.launch import snapshots


def carry_out(strategy, model, request, shared):
    """One request on this rank (``strategy``: its ``DDPStrategy``; ``shared``: every
    rank can read the checkpoint's file, a pool)."""
    kind, folder, extra = request
    if kind == "save":
        save(strategy, model, folder, extra)
    elif kind == "restore":
        restore(strategy, model, folder, extra, shared)
    else:
        raise ValueError(f"kmgpu: a checkpoint request {kind!r}")


def _layout(model, variables):
    """The replica's ``StateLayout``, whose arrays must be the checkpoint's."""
    layout = replicas.layout_of(model, True)
    if len(layout.arrays) != len(variables):
        raise ValueError(f"kmgpu: a checkpoint of {len(variables)} arrays, a state of "
                         f"{len(layout.arrays)}: this model's variables are not its weights "
                         "and optimizer state alone")
    return layout


def save(strategy, model, folder, extra):
    rank, device = strategy.rank, strategy.device
    variables, counts = checkpoint_files.state_variables(model)
    layout = _layout(model, variables)
    entries = checkpoint_files.entries_of(variables)
    pieces = strategy.pieces_out
    epoch, keep = extra["epoch"], extra["keep"]
    directory = os.path.dirname(folder)
    if rank == 0:
        folder, arrays = checkpoint_files.create(directory, epoch, entries)
    if pieces:
        snapshots.everywhere(device, 0, sum_=True)  # the file exists
        if rank != 0:
            arrays = checkpoint_files.Arrays(os.path.join(folder, checkpoint_files.DATA),
                                             entries, writable=True)
        replicas.write_pieces(arrays, 0, model, layout, strategy._weight_shards(), rank)
        snapshots.everywhere(device, 0, sum_=True)  # every rank has written
    elif rank == 0:
        replicas.write_pieces(arrays, 0, model, layout, None, rank)
    if rank == 0:
        info = {k: v for k, v in extra.items() if k not in ("epoch", "keep")}
        # the random states every rank draws the next epoch's order from (the same)
        info["random"] = checkpoint_files.host_random_state()
        checkpoint_files.finish(directory, folder, arrays, counts, epoch, info, keep)


def restore(strategy, model, folder, manifest, shared):
    variables, counts = checkpoint_files.state_variables(model)
    checkpoint_files.check_matches(manifest, variables, counts, folder)
    layout = _layout(model, variables)
    load = None
    if shared or strategy.rank == 0:
        load = snapshots.SlotZero(checkpoint_files.open_arrays(folder, manifest), layout)
    strategy.receive_state(model, load, shared=shared)
    checkpoint_files.set_host_random_state(manifest.get("random"))

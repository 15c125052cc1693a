"""A pool rank's side of the state in and the snapshots out.

- ``SlotZero``: slot 0 of the state file (``transport.StateFile``), the state the driver
  sent, into the replica: whole, or only this rank's pieces of it (``load_pieces``:
  slices of a mapped file, as a ``ShardedCheckpoint``'s restore reads them).
- ``Snapshots``: the replica's state at epoch ends, the end of training and an early
  stop, so an interrupted fit leaves the last consistent state: into the state file's
  snapshot slots (rank 0 writes it whole), or under shard="weights" over the pipes
  (``state_pipe``: every rank sends its own pieces into your model; nothing is gathered).

Where a pool call's state lives (weights, optimizer state, learning rate):

- your model (the driver): whole, before and after the call. The ranks get it when
  they do not hold it already, and again when its callbacks change the model at the
  fit's start: shard="weights" each rank's pieces straight from your model's variables
  (``state_pipe``), else through slot 0 (written straight from its variables). It gets
  the newest snapshot when its callbacks read the weights (an epoch end, fit's
  validation) and at the call's end.
- slot 0: from the call's start until every rank has taken it (``SlotZero.taken``), then
  its pages are given back.
- each rank, for the pool's life: shard="weights" its 1/N pieces only (made without a
  whole copy: ``optim.unfilled``); other shard values the whole weights and its part of
  the optimizer state.
- the snapshots: the state at an epoch end, at the end of training and where a fit
  stopped, gathered whole into rank 0 first (``zero.Shards.materialize``) and written
  into a snapshot slot; the older slot is given back once a newer one is complete (at
  most two, for the moment one is written), every slot once the driver has loaded the
  call's state. Under shard="weights" each rank's pieces go into your model as they
  are sent, no process but the driver ever holds the state whole, and an epoch end
  sends one only when the driver's callbacks read the weights.
"""

import time


class SlotZero:
    """Slot 0 of the state file (the state the driver sent) into a replica: whole
    (``__call__``), or only this rank's pieces of a sharded state (``pieces``)."""

    def __init__(self, state, layout):
        self.state, self.layout = state, layout

    def __call__(self, model):
        from kmgpu.engines.torch import replicas

        replicas.load_arrays(model, self.state.read(0, copy=False), self.layout,
                             absent_zero=True)

    def taken(self, rank, device, everyone):
        """Once the state is in the replicas (``everyone``: every rank read its pieces, an
        all-reduce tells; else rank 0 alone read it), rank 0 gives slot 0's pages back:
        no one reads it again unless the driver writes it again first (its callbacks
        changed the model), so a fit does not hold the state it was sent."""
        if everyone:
            everywhere(device, 0, sum_=True)
        if rank == 0:
            self.state.free(0)

    def pieces(self, model, zero):
        from kmgpu.engines.torch import replicas

        return replicas.load_pieces(model, self.state.read(0, copy=False), self.layout, zero)


class Snapshots:
    """The replica's state into a snapshot, when it is worth it.

    Always at the end of training and when the driver's callbacks will look at
    the weights after this epoch; otherwise at an epoch end only once the time
    since the last snapshot is 20x what one costs (so at most ~5% of the time),
    which still leaves an interrupted fit the state of a recent epoch end. Never
    otherwise under shard="weights" (``pieces``): a snapshot there overwrites your
    model's state with the ranks' (a whole copy of the state would be needed to keep
    both); a fit whose worker dies leaves your model the state it had when the call
    started. The end of training writes nothing when the state is still the last
    epoch end's (a one-epoch fit: one copy of the state per call, not two): that
    snapshot is relabelled.

    Rank 0 writes the whole state into a slot of the state file, or with ``pieces``
    (shard="weights": the ``zero.Shards``, this rank, its device) every rank sends its
    own pieces (``replicas.pieces_out``; with ``slots=False`` not those of the
    optimizer's slots, which stay in the ranks until the driver asks:
    ``launch.held_slots``) over its pipe (``pipe``: ``state_pipe.RankPipe``), or writes
    them into the file (``replicas.write_pieces``). Rank 0 decides and tells the others
    (a broadcast); an all-reduce then tells that every rank has written, so rank 0
    marks a file's slot complete only with every rank's pieces (the older one stays
    until then), and relays the epoch's end only once your model has them all.
    """

    SKIP, RELABELLED, WRITE = 0, 1, 2

    def __init__(self, state, layout, every_epoch, clock, pieces=None, slots=True, pipe=None):
        self.state, self.layout, self.every_epoch, self.clock = state, layout, every_epoch, clock
        self.pieces, self.slots, self.pipe = pieces, slots, pipe
        self.rank = pieces[1] if pieces is not None else 0
        self.seq, self.cost, self.last, self.versions = 0, 0.0, None, None
        self.missing = ()  # the arrays the newest snapshot left out

    def __call__(self, model, epoch):
        """Save at ``epoch``'s end; -1: the end of training, -2: the fit stopped early
        (a callback raised, or Ctrl-C on the driver): both always save."""
        from kmgpu.engines.torch import replicas

        now = time.perf_counter()
        what = self._decide(model, epoch, now) if self.rank == 0 else None
        if self.pieces is not None:
            what = everywhere(self.pieces[2], what)
        if what != self.WRITE:
            if what == self.RELABELLED:
                self.clock("snapshots", since=now)
            return
        self.seq += 1
        slot = 1 + self.seq % 2
        if self.pipe is not None:  # straight into your model (``state_pipe``)
            zero, rank, device = self.pieces if self.pieces is not None else (None, 0, None)
            found, self.missing = replicas.pieces_out(model, self.layout, zero, rank,
                                                      slots=self.slots)
            self.pipe.send(found, self.seq, epoch, _writers(zero), self.missing)
            if device is not None:
                everywhere(device, 0, sum_=True)  # every rank's pieces are in your model
        elif self.pieces is None:
            replicas.write_state(self.state, slot, model, self.layout, seq=self.seq, epoch=epoch)
        else:
            zero, rank, _ = self.pieces
            missing = replicas.write_pieces(self.state, slot, model, self.layout, zero, rank,
                                            slots=self.slots)
            everywhere(self.pieces[2], 0, sum_=True)  # every rank has written its pieces
            if rank == 0:
                self.state.complete(slot, self.seq, epoch, missing)
        if self.rank == 0 and self.pipe is None:
            self.state.free(3 - slot)  # the older snapshot: this one is complete
        self.versions = self._versions(model)
        self.last = time.perf_counter()
        self.cost = self.last - now
        self.clock("snapshots", since=now)

    def _decide(self, model, epoch, now):
        """Rank 0: skip, relabel the newest snapshot (done here) or write one."""
        if epoch >= 0 and not self.every_epoch and (
                self.pieces is not None
                or (self.last is not None and now - self.last < 20 * self.cost)):
            return self.SKIP
        if epoch < 0 and self._relabel(model, epoch):
            return self.RELABELLED
        return self.WRITE

    def _versions(self, model):
        from kmgpu.engines.torch import replicas
        from kmgpu.engines.torch.optim import piece_state

        found = replicas.state_versions(model)
        if self.pieces is not None:
            found += piece_state.versions(self.pieces[0])
        return found

    def _relabel(self, model, epoch):
        """True when the newest snapshot is ``model``'s state but for the learning rate
        (the driver's scaling callbacks set it again at train end): that one array is
        written and the snapshot relabelled ``epoch``."""
        from kmgpu.engines import replication

        if self.versions is None:
            return False
        lr = replication.lr_variable(model)
        lr = lr.value if lr is not None else None
        now = self._versions(model)
        if len(now) != len(self.versions):
            return False
        changed = [a for (a, va), (b, vb) in zip(now, self.versions) if a is not b or va != vb]
        if any(a is not lr for a in changed):
            return False
        slot = 1 + self.seq % 2  # the newest
        if changed and not self.layout.has_lr:
            return False
        if self.pipe is not None:
            if changed:  # your model holds the newest snapshot: the rate goes in
                self.seq += 1
                self.pipe.send([(len(self.layout.arrays) - 1, 0, 1, lr.detach().reshape(-1))],
                               self.seq, epoch, 1, self.missing)
            return True
        if changed:
            self.state.write_one(slot, len(self.layout.arrays) - 1, lr.detach().cpu().numpy())
        self.state.relabel(slot, epoch)
        return True


def send_slots(state, query, model, zero, rank, device, pipe=None):
    """A ``messages.SlotsQuery`` on one rank: its pieces of the optimizer variables the
    query names (``zero``: the replica's ``zero.Shards`` under shard="weights"; None:
    rank 0 writes them whole) into your model over ``pipe`` (``state_pipe.RankPipe``),
    or into the query's slot of the state file, which rank 0 marks complete once every
    rank has written. Nothing is gathered."""
    from kmgpu.engines.torch import replicas

    if pipe is not None:
        found, missing = replicas.pieces_out(model, query.layout, zero, rank,
                                             indices=set(query.indices))
        if zero is not None or rank == 0:
            pipe.send(found, 1, -1, _writers(zero), missing)
        return
    missing = replicas.write_pieces(state, query.slot, model, query.layout, zero, rank,
                                    indices=set(query.indices))
    everywhere(device, 0, sum_=True)
    if rank == 0:
        state.complete(query.slot, missing=missing)


def _writers(zero):
    """How many ranks send their part of a snapshot: each its own pieces (``zero``),
    or rank 0 the whole state."""
    import torch.distributed as dist

    return dist.get_world_size() if zero is not None else 1


def everywhere(device, value, sum_=False):
    """Rank 0's ``value`` on every rank (a broadcast), or with ``sum_`` an all-reduce
    (it returns once every rank has called it)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value or 0], dtype=torch.int64, device=device)
    if sum_:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)
    return int(t.item())

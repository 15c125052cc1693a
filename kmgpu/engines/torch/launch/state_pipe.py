"""shard="weights" in a pool: the state between your model and the ranks over their pipes.

A file between them would hold a whole copy of what it carries (the weights at a call's
start, the weights and slots of a snapshot) in /dev/shm, and each rank that maps it counts
its pages again. Over the pipes there is no such copy: each rank asks your model's
variables for the elements its pieces hold and receives them straight into its pieces
(``RankPipe``: ``snapshots.SlotZero``'s interface), and sends its pieces of a snapshot
straight into your model's variables (``DriverPipe``). The only whole copy of the state
outside the ranks is your model's own.

- In: a rank sends ``Want`` (the flat element ranges it needs: its pieces' spans, and the
  variables it keeps whole); the driver answers with each range's raw bytes, in order.
  The ranks ask at a call's start and when the driver's callbacks changed your model
  (``Reply.reload``), so they always read your model as it is then.
- Out: at a snapshot (the end of training, a stop, an epoch end whose callbacks read the
  weights, the slots the driver asks for), every rank that holds part of it sends
  ``Pieces`` and the bytes; the driver writes them into your model's variables and
  answers True, so a rank goes on only once the driver has its part. A snapshot is
  complete once all its writers were heard: its number, epoch and the arrays it left
  out (the slots the ranks keep) are then ``DriverPipe.complete``'s.

A worker that dies between the first and the last rank's part of a snapshot leaves your
model holding that snapshot's parts it received and the earlier state elsewhere
(``DriverPipe.partial`` says so); with a file it would hold the earlier state whole, at
the price of that whole copy. The byte transfers are a few milliseconds per hundred
megabytes of state.
"""

import numpy as np
import torch

from kmgpu.engines.torch import replicas
from kmgpu.engines.torch.launch.messages import Pieces, Want
from kmgpu.engines.torch.optim import held


def file_layout(piped, layout):
    """The arrays of a call's state file: none where the state goes over the pipes (the
    file keeps only its control page: the driver's stop request), else ``layout``'s. So
    a piped call neither makes nor maps a file sized for the whole state."""
    return () if piped else layout.arrays


def _flat(tensor):
    """A 1-D view of ``tensor``'s elements (writing it writes the tensor)."""
    return tensor.detach().view(-1)


def _bytes(tensor):
    """The raw bytes of a contiguous CPU tensor, as a writable NumPy array."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


@torch.no_grad()
def send_from(conn, tensor):
    """``tensor``'s elements (1-D) as one raw message."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.to("cpu").contiguous()
    conn.send_bytes(_bytes(tensor))


@torch.no_grad()
def receive_into(conn, tensor):
    """One raw message into ``tensor``'s elements (1-D; received in place on the CPU)."""
    direct = tensor.device.type == "cpu" and tensor.is_contiguous()
    buffer = tensor if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
    target = _bytes(buffer)
    got = conn.recv_bytes_into(target)
    if got != target.nbytes:
        raise RuntimeError(f"kmgpu: {got} bytes of state came for {target.nbytes}: the driver "
                           "and the worker disagree on the model's variables")
    if not direct:
        tensor.copy_(buffer)


class RankPipe:
    """A pool rank's side (``Call.piped``): ``snapshots.SlotZero``'s interface for the
    state in (``__call__``, ``pieces``, ``taken``), ``send`` for snapshots out.

    Args:
        conn: this rank's pipe to the driver.
        layout: the call's ``StateLayout``.
        absent: the arrays the driver does not send at the call's start (a new
            optimizer's zero slots); later loads (``Reply.reload``) take every array.
    """

    def __init__(self, conn, layout, absent=()):
        self.conn, self.layout, self.absent = conn, layout, set(absent)

    def _receive(self, wanted):
        """Ask for ``wanted`` [(array index, start, stop, 1-D tensor)] and receive each
        range into its tensor."""
        wanted = [w for w in wanted if w[2] > w[1]]
        self.conn.send(Want(tuple((i, lo, hi) for i, lo, hi, _ in wanted)))
        for _, _, _, tensor in wanted:
            receive_into(self.conn, tensor)

    def _absent(self):
        absent, self.absent = self.absent, set()
        return absent

    def __call__(self, model):
        """The whole state into ``model`` (a replica that holds nothing in pieces, or
        whose variables ``pieces`` refused: ``replicas.load_arrays`` says why)."""
        absent = self._absent()
        arrays = [None if i in absent else np.empty(shape, dtype)
                  for i, (shape, dtype) in enumerate(self.layout.arrays)]
        self._receive([(i, 0, a.size, torch.from_numpy(a.reshape(-1).view(np.uint8)))
                       for i, a in enumerate(arrays) if a is not None])
        replicas.load_arrays(model, arrays, self.layout, absent_zero=True)

    def pieces(self, model, zero):
        """Only this rank's pieces of the weights and slots ``zero`` holds, every other
        variable whole; False, receiving nothing, when ``model``'s variables do not
        match the layout."""
        import keras

        from kmgpu.engines.torch.optim import piece_state, placement

        variables = replicas.transfer_variables(model, self.layout)
        if len(variables) != len(self.layout.arrays) or any(
                tuple(v.shape) != tuple(shape)
                for v, (shape, _) in zip(variables, self.layout.arrays)):
            return False
        absent = self._absent()
        index = {id(v): i for i, v in enumerate(variables)}
        sharded = placement.sharded_ids(zero)

        def copy(spans):
            wanted = [(index[id(v)], lo, hi, own) for v, lo, hi, own in spans
                      if id(v) in index and index[id(v)] not in absent]
            for i, v in enumerate(variables):
                if id(v) in sharded:
                    continue
                if i in absent:
                    v.assign(keras.ops.zeros(v.shape, v.dtype))
                else:
                    wanted.append((i, 0, int(v.value.numel()), _flat(v.value)))
            self._receive(wanted)

        piece_state.fill(zero, copy)
        return True

    def taken(self, rank, device, everyone):
        """Nothing to give back: no copy of the state was made."""

    def send(self, found, seq, epoch, writers, missing=()):
        """This rank's part of snapshot ``seq`` (``found``: ``replicas.pieces_out``'s
        ranges and tensors) into your model; returns once the driver has it."""
        found = [f for f in found if f[2] > f[1]]
        self.conn.send(Pieces(tuple((i, lo, hi) for i, lo, hi, _ in found), seq, epoch,
                              writers, tuple(missing)))
        for _, _, _, tensor in found:
            send_from(self.conn, tensor)
        if self.conn.recv() is not True:
            raise RuntimeError("kmgpu: the driver did not take this worker's state")


class DriverPipe:
    """The driver's side for one call (or one ``SlotsQuery``): serves ``Want`` from
    ``template``'s variables and writes ``Pieces`` into them (``WorkerPool.call``'s
    ``on_state``). A held optimizer slot (``optim.held``) is read and written without
    being fetched: its tensor is the one the ranks' values go into.

    Args:
        template: your model.
        layout: the call's ``StateLayout``.
    """

    def __init__(self, template, layout):
        self.variables = replicas.transfer_variables(template, layout)
        self.heard = {}  # snapshot number -> the ranks heard
        self.complete = []  # (seq, epoch, missing) of every complete snapshot, in order

    @property
    def partial(self):
        """Some rank's part of a snapshot came, but not every writer's."""
        done = {c[0] for c in self.complete}
        return any(seq not in done for seq in self.heard)

    def __call__(self, conn, msg):
        if isinstance(msg, Want):
            for i, lo, hi in msg.ranges:
                send_from(conn, _flat(held.raw(self.variables[i]))[lo:hi])
            return
        for i, lo, hi in msg.ranges:
            receive_into(conn, _flat(held.raw(self.variables[i]))[lo:hi])
        heard = self.heard[msg.seq] = self.heard.get(msg.seq, 0) + 1
        if heard == msg.writers:
            self.complete.append((msg.seq, msg.epoch, tuple(msg.missing)))
        conn.send(True)

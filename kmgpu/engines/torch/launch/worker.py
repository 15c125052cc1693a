"""A worker process of kmgpu's torch pool: one rank, one device, many calls.

``main`` is the process's target (``pool.WorkerPool`` starts it). It sends its
stdout/stderr into a pipe the driver reads, ignores SIGINT (the driver decides),
leaves when the driver goes, joins the process group (rank 0 hosts a TCPStore on a
free loopback port), then answers ``messages`` until told to ``Exit``, which it does
with ``barrier()``, ``destroy_process_group()`` and ``os._exit(0)`` (no gloo/NCCL
abort at exit). ``Worker`` holds this rank's replica between calls.
"""

import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback

# Keras is imported only once the worker has set its environment (KERAS_BACKEND,
# threads, device): inputs, replicas and strategy, which import it, are imported late.
from kmgpu.engines import heap
from kmgpu.engines.torch import transport
from kmgpu.engines.torch.launch import snapshots, timing
from kmgpu.engines.torch.launch.messages import (END_MARK, Aborted, Call, Done, Exit, Failed, Port,
                                                 RankResult, Ready, Reply, SlotsQuery,
                                                 WeightsQuery)


def _redirect(out_conn):
    fd = out_conn.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    out_conn.close()
    # New objects: the inherited sys.stdout may be a capture object or a Jupyter
    # stream (and its lock may have been held by another thread at fork).
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="replace", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="replace", write_through=True)


def _watch_parent(parent):
    def watch():
        while True:
            if os.getppid() != parent:
                try:  # it died without exiting: its data and state files go with it
                    transport.remove_leftovers(parent)
                finally:
                    os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="kmgpu-parent-watch").start()


def _end_call():
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(1, END_MARK)


def _is_collective_failure(exc):
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed", "Connection reset", "gloo",
                                   "NCCL", "ProcessGroup", "Broken pipe"))


def _send_error(conn, exc):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    try:
        collective = _is_collective_failure(exc)
    except Exception:
        collective = False
    try:
        conn.send(Failed(blob, tb, collective))
    except Exception:  # the driver is gone or the pipe broke: it sees the exit code
        pass


def _join_group(rank, world, device, conn, settings):
    """Import Keras on ``device`` and join the process group (rank 0 hosts the store)."""
    import torch

    torch.set_num_threads(settings["threads"])
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    import keras

    for name, value in settings.get("keras_config", {}).items():
        getattr(keras.config, f"set_{name}")(value)
    # Keras's torch default device was fixed when the driver imported it: this
    # worker's device holds everything it creates, for the life of the process.
    keras.device(device).__enter__()
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=settings.get("timeout", 1800))
    if rank == 0:
        # the store's own socket would listen on every interface: hand it one
        # that listens on loopback only (kept open for the life of the process)
        import socket

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], world_size=world,
                              is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())
        conn.send(Port(store.port))
    else:
        port = conn.recv().port
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False,
                              timeout=timeout)
    kwargs = {}
    if device.startswith("cuda"):
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(settings["backend"], store=store, rank=rank,
                            world_size=world, timeout=timeout, **kwargs)


def main(rank, world, device, conn, out_conn, settings):
    """The worker process: join the group, then answer the driver until ``Exit``.

    Args:
        rank, world: this rank and the number of ranks.
        device: "cpu" or "cuda:<i>".
        conn: the duplex pipe to the driver (messages).
        out_conn: the pipe stdout and stderr go to.
        settings: env, Keras config, threads, backend, the driver's pid.
    """
    import gc

    # Forked: never collect what the driver left behind. Its garbage may hold torch
    # process groups (a DDP Reducer of an in-process rank, say) whose destructors wait
    # on the driver's gloo threads, which do not exist here: seen hanging a worker in
    # gc inside DataLoader.__init__ (pthread_cond_broadcast in ~ProcessGroupGloo).
    gc.freeze()
    _redirect(out_conn)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(settings["parent"])
    try:
        for key, value in settings.get("env", {}).items():
            os.environ[key] = value  # e.g. GLOO_SOCKET_IFNAME=lo, whatever the driver has
        if not device.startswith("cuda"):
            # a CPU rank's device memory is host memory: its layer-sized blocks (gathered
            # weights, gradients, collectives' buffers) go back to the system when freed
            heap.map_large_blocks()
        _join_group(rank, world, device, conn, settings)
        worker = Worker(device, conn)
        conn.send(Ready(os.getpid()))
    except BaseException as e:
        _send_error(conn, e)
        os._exit(1)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(2)
        if isinstance(msg, Exit):
            import torch.distributed as dist

            try:
                dist.barrier()
                dist.destroy_process_group()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        try:
            result = worker.handle(msg)
        except BaseException as e:
            _end_call()
            _send_error(conn, e)
            os._exit(1)
        _end_call()
        conn.send(Done(result))
        # a call's whole-state buffers and per-step tensors leave hundreds of MB free but
        # resident in the heap, held between calls for the pool's life; not after a
        # *_on_batch call, whose loop would fault those pages in again each time
        if isinstance(msg, Call) and msg.method in ("fit", "evaluate", "predict"):
            heap.trim_heap()


class Worker:
    """This rank's replica and the strategy it was made with (kept between calls), and
    what a call does with them.

    Args:
        device: "cpu" or "cuda:<i>".
        conn: the pipe to the driver (for relayed callback events).
    """

    def __init__(self, device, conn):
        import torch.distributed as dist

        # imported now, before Ready, so that the first call does not wait for it
        from kmgpu.engines.torch import strategy  # noqa: F401

        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.strategy = None  # made with each replica, from the call's config
        self.replica, self.key = None, None
        self.conn = conn
        self._state, self._state_key = None, None  # the pool's state file, mapped once

    def _state_file(self, call):
        """The call's ``transport.StateFile``: the last call's mapping when it is the same
        file and layout (its pages stay mapped; a new mapping faults each page in again)."""
        from kmgpu.engines.torch.launch import state_pipe

        key = (call.state_path, state_pipe.file_layout(call.piped, call.layout))
        if key != self._state_key:
            self._state = None  # the old mapping goes before the new one is made
            self._state = transport.StateFile(call.state_path, key[1])
            self._state_key = key
        return self._state

    def relay(self, event):
        """Rank 0: run the user's callbacks on the driver; wait for its Reply."""
        self.conn.send(event)
        reply = self.conn.recv()
        if not isinstance(reply, Reply):
            raise RuntimeError(f"kmgpu: expected the driver's reply, got {reply!r}")
        return reply

    def _replica(self, call):
        from kmgpu.engines import replication
        from kmgpu.engines.torch import replicas
        from kmgpu.engines.torch.strategy import DDPStrategy

        if call.key == self.key and self.replica is not None:
            return self.replica
        if call.model is None:
            raise RuntimeError("kmgpu: the worker has no model for this call")
        self.replica, self.key = None, None
        # a sharded optimizer state is gathered on rank 0 only: the driver reads rank 0's
        self.strategy = DDPStrategy(self.device, call.config)
        # this process's random generators are its own: nothing to keep. shard="weights":
        # built in host memory, only this rank's pieces go to the device (``building``),
        # the sharded variables made without memory: the state file fills the pieces
        with self.strategy.building():
            replica = replication.make_replica(
                replicas.FromSpec(call.model, unfilled=self.strategy.host_built),
                rows=lambda batch: batch // self.world,
                lr_scale=call.lr_scale, finish=self.strategy.prepare, keep_host_random=False)
        self.replica, self.key = replica, call.key
        return replica

    def handle(self, msg):
        """Answer one message from the driver.

        Returns:
            For a Call, this rank's ``RankResult``; for a WeightsQuery, the replica's
            weights (None before the first call).
        """
        if isinstance(msg, WeightsQuery):  # for tests: this rank's replica state
            if msg.what == "held":
                return self.strategy.held_bytes() if self.strategy is not None else None
            return None if self.replica is None else self.replica.get_weights()
        from kmgpu.engines.torch.launch import state_pipe

        if isinstance(msg, SlotsQuery):  # the optimizer's slots, kept here, to the driver
            s = self.strategy
            piped = msg.state_path is None
            snapshots.send_slots(None if piped else self._state_file(msg), msg, self.replica,
                                 s._weight_shards() if s.pieces_out else None, self.rank,
                                 self.device,
                                 state_pipe.RankPipe(self.conn, msg.layout) if piped else None)
            return None
        if not isinstance(msg, Call):
            raise RuntimeError(f"kmgpu: a worker got {msg!r}")
        from kmgpu.engines.torch import replicas
        from kmgpu.engines.torch.data import feeds, inputs, shuffle

        call = msg
        clock = timing.Clock("worker", self.rank == 0)
        replica = self._replica(call)
        s = self.strategy  # the one this replica was made with
        clock("replica")
        state = self._state_file(call)

        # the template's state, or the driver's callbacks': over the pipe, or slot 0
        pipe = state_pipe.RankPipe(self.conn, call.layout, call.absent) if call.piped else None
        reload = pipe or snapshots.SlotZero(state, call.layout)
        if call.state_in:  # else the replicas hold the template's state already
            # every rank reads the same file: rank 0 loads and broadcasts, or with
            # shard="weights" each rank copies only its pieces from the file
            s.receive_state(replica, reload, shared=True)
            reload.taken(self.rank, self.device, everyone=s.pieces_out)
        s.write_state_rows(replica, call.rnn_states)
        clock("state in")
        kwargs = inputs.receive(call.kwargs)

        before = None if call.method in ("fit", "train_on_batch") else \
            replicas.state_versions(replica)
        snapshot = None
        # shard="weights": every rank writes its own pieces of the state, none gathers it
        pieces = (s.sharded_step.zero, self.rank, self.device) if s.pieces_out else None
        if call.method == "fit" and (self.rank == 0 or pieces):
            snapshot = snapshots.Snapshots(state, call.layout, call.epoch_weights, clock, pieces,
                                           slots=call.slots_back, pipe=pipe)
        shuffle.set_state(call.rng)  # the driver's: the same order on every rank
        result = s.run(replica, call.method, kwargs, hooks=call.hooks,
                       relay=self.relay, snapshot=snapshot,
                       reload=reload if call.method == "fit" else None,
                       reset_states=call.reset_states,
                       fit_callbacks=[feeds.NextPass(kwargs.get("x"),
                                                     kwargs.get("validation_data")),
                                      _stop_on_request(state, self.rank)])
        if isinstance(result, Aborted) and snapshot is not None:
            snapshot(replica, -2)  # stopped: the last completed step's state goes back
        if call.method == "train_on_batch" and (self.rank == 0 or pieces):
            snapshots.Snapshots(state, call.layout, True, clock, pieces,
                                slots=call.slots_back, pipe=pipe)(replica, -1)  # the new state
        if call.method in ("fit", "train_on_batch"):
            s.let_go()  # written out: rank 0's whole copy of a sharded state freed
        clock(call.method)
        clock.report()
        # this rank's stateful RNN rows go back to the user's model, like the weights
        rows = s.last_rows if call.method.endswith("_on_batch") else None
        touched = before is not None and not replicas.unchanged(replica, before)
        return RankResult(result, s.state_rows(replica), rows, touched,
                          shuffle.state() if self.rank == 0 else None)


def _stop_on_request(state, rank):
    """Rank side of the driver's Ctrl-C (``transport.StateFile.request_stop``)."""
    import keras

    from kmgpu.engines.torch.launch.relay import Abort

    class StopOnRequest(keras.callbacks.Callback):
        """At every training step's start: rank 0, once it sees the driver's request at
        step t, sets "stop before t + 1"; every rank raises ``Abort`` there.

        Every step holds a collective, so no rank completes step t before rank 0
        starts it: each reaches step t + 1's start after the mark is set, and none
        has passed it. Only a read of shared memory per step; no collective.
        """

        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_begin(self, batch, logs=None):
            step, self.step = self.step, self.step + 1
            if rank == 0 and state.stop_requested():
                state.stop_before(step + 1)
            stop = state.stop_before()
            if 0 <= stop <= step:
                raise Abort("stopped by the driver (Ctrl-C)")

    return StopOnRequest()

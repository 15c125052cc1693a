"""A worker process of kmgpu's torch pool: one rank, one device, many calls.

``main`` is the process's target. It sends its stdout/stderr into a pipe the
parent reads, ignores SIGINT (the parent decides), leaves when the parent goes,
joins the process group (rank 0 hosts a TCPStore on a free loopback port), then
answers calls until told to exit, which it does with ``barrier()``,
``destroy_process_group()`` and ``os._exit(0)`` (no gloo/NCCL abort at exit).
"""

import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback


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
                    from kmgpu.engines.torch.pool import remove_leftovers

                    remove_leftovers(parent)
                finally:
                    os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="kmgpu-parent-watch").start()


def _end_call():
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        from kmgpu.engines.torch.pool import END_MARK

        os.write(1, END_MARK)


def _is_collective_failure(exc):
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed", "Connection reset", "gloo",
                                   "NCCL", "ProcessGroup", "Broken pipe"))


def main(rank, world, device, conn, out_conn, settings):
    _redirect(out_conn)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(settings["parent"])
    try:
        for key, value in settings.get("env", {}).items():
            os.environ[key] = value  # e.g. GLOO_SOCKET_IFNAME=lo, whatever the parent has
        import torch

        torch.set_num_threads(settings["threads"])
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        import keras

        for name, value in settings.get("keras_config", {}).items():
            getattr(keras.config, f"set_{name}")(value)
        # Keras's torch default device was fixed when the parent imported it: this
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
            conn.send(("port", store.port))
        else:
            kind, port = conn.recv()
            store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False,
                                  timeout=timeout)
        kwargs = {}
        if device.startswith("cuda"):
            kwargs["device_id"] = torch.device(device)
        dist.init_process_group(settings["backend"], store=store, rank=rank,
                                world_size=world, timeout=timeout, **kwargs)
        worker = Worker(rank, world, device, settings, conn)
        conn.send(("ready", os.getpid()))
    except BaseException as e:
        _send_error(conn, e)
        os._exit(1)

    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            os._exit(2)
        if kind == "exit":
            try:
                dist.barrier()
                dist.destroy_process_group()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        try:
            result = worker.handle(payload)
        except BaseException as e:
            _end_call()
            _send_error(conn, e)
            os._exit(1)
        _end_call()
        conn.send(("ok", result))


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
        conn.send(("error", blob, tb, collective))
    except Exception:  # the parent is gone or the pipe broke: it sees the exit code
        pass


class Worker:
    """This rank's replica (kept between calls) and what a call does with it."""

    def __init__(self, rank, world, device, settings, conn):
        import torch

        from kmgpu.engines.torch import rank as _torch_rank

        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.settings = settings
        self.ctx = _torch_rank.RankContext(self.device, settings["sync_batchnorm"])
        self.replica, self.key = None, None
        self.seq = 0
        self.conn = conn

    def relay(self, hook, index, logs, params):
        """Rank 0: run the user's callbacks in the parent; wait for its answer."""
        self.conn.send(("event", (hook, index, logs, params)))
        kind, reply = self.conn.recv()
        if kind != "reply":
            raise RuntimeError(f"kmgpu: expected the parent's reply, got {kind!r}")
        return reply

    def _replica(self, payload):
        import keras

        from kmgpu import models
        from kmgpu.engines.torch import rank as _torch_rank

        if payload["key"] == self.key and self.replica is not None:
            return self.replica
        spec = payload["model"]
        if spec is None:
            raise RuntimeError("kmgpu: the worker has no model for this call")
        if spec["custom_objects"] is not None:
            custom = pickle.loads(spec["custom_objects"])
        else:  # they could not be pickled: this worker was forked after they existed
            from kmgpu.engines.torch import pool as _torch_pool

            custom = dict(_torch_pool.INHERITED["custom_objects"])
        self.replica, self.key = None, None
        self.ctx.sync_batchnorm = payload["sync_batchnorm"]
        with keras.saving.custom_object_scope(custom):
            replica = keras.saving.deserialize_keras_object(spec["model"])
            if not replica.built and spec.get("build_config"):
                replica.build_from_config(spec["build_config"])
            fixed = models.fixed_batch(replica)
            if fixed is not None:  # this rank's B/N state rows (the weights come next)
                replica = models.clone_at(replica, fixed // self.world)
            if spec["compile"] is not None:
                _compile(replica, spec["compile"], payload.get("lr_scale", (1.0, 0)))
        _torch_rank.prepare(replica, self.ctx)
        self.replica, self.key = replica, payload["key"]
        return replica

    def handle(self, payload):
        from kmgpu.engines.torch import pool as _torch_pool
        from kmgpu.engines.torch import rank as _torch_rank

        method = payload["method"]
        if method == "weights":  # for tests: this rank's replica state
            return None if self.replica is None else self.replica.get_weights()
        clock = _Clock(self.rank == 0 and os.environ.get("KMGPU_TORCH_TIMING"))
        replica = self._replica(payload)
        clock("replica")
        state = _torch_pool.StateFile(payload["state"]["path"], payload["state"]["layout"])
        try:
            if self.rank == 0:
                _load_state(replica, state.read(0), payload["state"])
            _torch_rank.broadcast_state(replica, self.ctx)
            _torch_rank.write_state_rows(replica, payload.get("rnn_states") or [], self.ctx)
            clock("state in")
            kwargs = _torch_pool.resolve(payload["kwargs"])
            for key in ("x", "validation_data"):
                if isinstance(kwargs.get(key), bytes):
                    kwargs[key] = pickle.loads(kwargs[key])
            snapshot = None
            if method == "fit" and self.rank == 0:
                snapshot = _Snapshots(state, payload["state"], payload["epoch_weights"], clock)
            reload = None
            if snapshot is not None:  # the parent's callbacks set the model's state
                def reload(model):
                    _load_state(model, state.read(0), payload["state"])
            result = _torch_rank.run(replica, self.ctx, method, kwargs, seed=payload["seed"],
                                     hooks=payload["hooks"], relay=self.relay,
                                     snapshot=snapshot, reload=reload,
                                     reset_states=payload.get("reset_states", False))
            clock(method)
            clock.report()
            # this rank's stateful RNN rows go back to the user's model, like the weights
            return {"result": result, "states": _torch_rank.state_rows(replica)}
        finally:
            state.close()


class _Clock:
    """KMGPU_TORCH_TIMING=1: rank 0 prints where a call's time went."""

    def __init__(self, on):
        self.on, self.t, self.parts = bool(on), time.perf_counter(), {}

    def __call__(self, name, since=None):
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - (since or self.t)
        if since is None:
            self.t = now

    def report(self):
        if self.on:
            print("kmgpu worker timing: " + ", ".join(f"{k} {v:.3f}s"
                                                     for k, v in self.parts.items()),
                  flush=True)


class _Snapshots:
    """Rank 0's state into the state file's snapshot slots, when it is worth it.

    Always at the end of training and when the parent's callbacks will look at
    the weights after this epoch; otherwise at an epoch end only once the time
    since the last snapshot is 20x what one costs (so at most ~5% of the time),
    which still leaves an interrupted fit the state of a recent epoch end.
    """

    def __init__(self, state, info, every_epoch, clock):
        self.state, self.info, self.every_epoch, self.clock = state, info, every_epoch, clock
        self.seq, self.cost, self.last = 0, 0.0, None

    def __call__(self, model, epoch):
        now = time.perf_counter()
        if (epoch != -1 and not self.every_epoch and self.last is not None
                and now - self.last < 20 * self.cost):
            return
        self.seq += 1
        self.state.write(1 + self.seq % 2, _state_arrays(model, self.info), seq=self.seq,
                         epoch=epoch)
        self.last = time.perf_counter()
        self.cost = self.last - now
        self.clock("snapshots", since=now)


def _compile(replica, compile_config, lr_scale):
    """``compile_from_config``, with a LearningRateSchedule scaled as kmgpu.lr says."""
    import keras
    from keras.src.saving import serialization_lib

    config = serialization_lib.deserialize_keras_object(compile_config)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    factor, warmup_steps = lr_scale
    if (factor != 1.0 or warmup_steps) and isinstance(
            getattr(optimizer, "_learning_rate", None),
            keras.optimizers.schedules.LearningRateSchedule):
        from kmgpu import lr

        optimizer.learning_rate = lr.ScaledSchedule(optimizer._learning_rate, factor,
                                                    warmup_steps)
    config["optimizer"] = optimizer
    replica.compile(**config)


def _load_state(replica, arrays, info):
    from kmgpu import models

    nw, no = info["n_weights"], info["n_optimizer"]
    replica.set_weights(arrays[:nw])
    opt = getattr(replica, "optimizer", None)
    if no and opt is not None:
        if not opt.built:
            opt.build(replica.trainable_variables)
        variables = models.optimizer_state(opt)
        if [tuple(v.shape) for v in variables] == [tuple(a.shape) for a in arrays[nw:nw + no]]:
            for v, a in zip(variables, arrays[nw:nw + no]):
                v.assign(a)
    if info["has_lr"] and opt is not None:
        opt._learning_rate.assign(arrays[-1])


def _state_arrays(model, info):
    from kmgpu import models

    arrays = model.get_weights()
    if info["n_optimizer"]:
        arrays += [v.numpy() for v in models.optimizer_state(model.optimizer)]
    if info["has_lr"]:
        arrays.append(model.optimizer._learning_rate.numpy())
    return arrays

"""Torch engine: ``DistributedDataParallel`` inside Keras's own ``fit``.

Keras 3.15 has no DDP in its torch trainer, so every rank runs Keras's ``fit`` /
``evaluate`` / ``predict`` on a replica whose ``train_step`` (the documented
extension point) runs the forward pass through DDP and weights the loss by the
rank's share of the global batch; ``_torch_rank`` holds that part.

The process model is chosen automatically:

- **in-process**: this process is already one rank of a distributed job
  (``torch.distributed`` is initialised, or torchrun's environment is set). DDP
  runs here; every process passes the same full data; kmgpu takes each rank's
  share, runs the user's callbacks on rank 0 only and returns the same History,
  metrics and predictions on every rank.
- **pool** (everything else): one worker process per device (gloo on CPU /
  simulated devices, NCCL on GPUs), started once and reused between calls
  (``_torch_pool``). The model travels as config + weights, the data once as
  memory-mapped files; rank 0's progress bar streams to this process's stdout;
  the trained weights and optimizer state land in the user's model.
"""

import atexit
import datetime
import json
import os
import sys

import numpy as np

from kmgpu import models
from kmgpu.engines.base import Engine

_SHARED_POOLS = {}  # (devices, backend) -> WorkerPool, reused by every engine on them
MAX_POOLS = 2  # live pools kept; the least recently used beyond that is closed


def in_distributed_job():
    """True when this process is one rank of a job (torch.distributed or torchrun env)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TorchEngine(Engine):
    name = "torch DistributedDataParallel"
    #: rank r's replica is built for B/N rows and keeps rows r*B/N ... of every batch
    supports_stateful = True

    def __init__(self, device_ids, available, options):
        super().__init__(device_ids, available, options)
        self._pool = None
        self._replica, self._built_key = None, None
        self._owns_group = False
        self._group_broken = False
        self.in_process = in_distributed_job()
        if self.in_process:
            self._init_in_process(available)
        else:
            kinds = [available[i] for i in self.device_ids]
            gpu = kinds[0][0] == "gpu"
            self.torch_devices = [f"cuda:{i}" if gpu else "cpu" for _, i in kinds]
            self.backend = "nccl" if gpu else "gloo"
            self.name = (f"torch DistributedDataParallel ({self.backend}, "
                         f"{self.num_replicas} worker process(es), reused between calls)")

    @classmethod
    def plain_fit_serves(cls, model, device_ids):
        # Keras's own torch fit crashes on stateful LSTMs: those need the engine.
        from kmgpu import models

        return (list(device_ids) == [0] and not in_distributed_job()
                and not models.stateful_layers(model))

    # -- the Engine interface ---------------------------------------------------------
    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        lr_scale = (float(lr_scale[0]), int(lr_scale[1]))
        if self._resets_states(template):
            models.reset_states(template)  # what the ranks start from; they reset each epoch
        if self.in_process:
            try:
                return self._run_here(method, template, kwargs, lr_scale)
            except BaseException:
                # A rank that failed may have left its peers inside a collective: a
                # barrier at exit would keep this process (and its sockets) alive, and
                # they would wait on it. Ending without one lets them fail too.
                self._group_broken = True
                raise
        return self._run_pool(method, template, kwargs, lr_scale)

    def _resets_states(self, template):
        return bool(models.stateful_layers(template)) and self.options.reset_states == "epoch"

    def batchnorm_mode(self):
        if self.num_replicas == 1:
            return "one device"
        if self.options.sync_batchnorm:
            return "global batch (sums all-reduced in the forward pass, with autograd)"
        return ("per replica; moving statistics averaged over replicas (weighted by "
                "batch share) after every step")

    def close(self):
        pool, self._pool = self._pool, None
        if pool is not None:
            key = (tuple(self.torch_devices), self.backend)
            if _SHARED_POOLS.get(key) is pool:
                del _SHARED_POOLS[key]
            pool.close()
        self._end_group()

    def _end_group(self):
        """The group kmgpu started under torchrun: leave it together (barrier, destroy)."""
        if self._owns_group:
            import torch.distributed as dist

            self._owns_group = False
            if dist.is_initialized() and not self._group_broken:
                try:  # bounded: after a peer died, a plain barrier can wait for 30 min
                    if dist.get_backend() == "gloo":
                        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
                    else:
                        dist.barrier()
                    dist.destroy_process_group()
                except RuntimeError:
                    pass  # a peer is gone: this process is ending anyway

    # -- for tests and describe() ---------------------------------------------------
    def worker_pids(self):
        """The pool's worker process ids (empty in-process or before the first call)."""
        return [] if self._pool is None or self._pool.closed else self._pool.pids

    def rank_weights(self):
        """Every rank's replica weights (trainable and non-trainable), rank order."""
        if self.in_process:
            import torch.distributed as dist

            out = [None] * self.num_replicas
            dist.all_gather_object(out, self._replica.get_weights())
            return out
        return self._pool.call([{"method": "weights"}] * self.num_replicas)

    # -- pool mode ------------------------------------------------------------------
    def _ensure_pool(self):
        from kmgpu.engines.torch import pool as _torch_pool

        key = (tuple(self.torch_devices), self.backend)
        pool = _SHARED_POOLS.pop(key, None)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.kill()
            while len(_SHARED_POOLS) >= MAX_POOLS:
                _SHARED_POOLS.pop(next(iter(_SHARED_POOLS))).close()
            pool = _torch_pool.WorkerPool(self.torch_devices, self.backend,
                                          _worker_settings(self.backend)).start()
        _SHARED_POOLS[key] = pool  # most recently used last
        self._pool = pool
        return pool

    def _fork_for(self, template):
        """Custom objects that cannot be pickled reach workers forked after they exist."""
        from kmgpu.engines.torch import pool as _torch_pool

        devices = self.torch_devices
        if _torch_pool.start_method(devices[0].startswith("cuda")) != "fork":
            raise TypeError(
                "kmgpu (torch): the model uses classes or functions that cannot be sent to "
                "spawned worker processes (defined inside a function or in a notebook). "
                "Move them to an importable module, or `pip install cloudpickle`.")
        key = (tuple(devices), self.backend)
        pool = _SHARED_POOLS.pop(key, None)
        if pool is not None:
            pool.close()  # the next pool is forked now, with the objects in memory

    def _run_pool(self, method, template, kwargs, lr_scale):
        from kmgpu.engines.torch import pool as _torch_pool

        kwargs = dict(kwargs)
        callbacks = kwargs.pop("callbacks", None)
        timing = _Timing()
        key = _model_key(template, self.options.sync_batchnorm, lr_scale)
        pool = _SHARED_POOLS.get((tuple(self.torch_devices), self.backend))
        spec = None
        if pool is None or not pool.alive() or pool.model_key != key:  # a new pool needs it
            spec, inherit = _model_spec(template)
            if inherit:
                self._fork_for(template)
        pool = self._ensure_pool()
        timing("pool")
        files = _torch_pool.CallFiles(_nbytes(kwargs))
        state = None
        try:
            shipped = _ship(kwargs, files)
            timing("data out")
            info, arrays = _template_state(template, with_optimizer=(method == "fit"))
            state = pool.state_file(info["layout"])
            state.write(0, arrays)
            timing("state out")
            driver = CallbackDriver(
                callbacks, template, method, load_state=lambda: _restore(template, state, info),
                push_state=lambda: state.write(0, _template_state(template, True)[1]))
            payload = {
                "method": method,
                "key": key,
                "model": None if pool.model_key == key else spec,
                "kwargs": shipped,
                "state": dict(info, path=state.path),
                "seed": int(np.random.randint(0, 2**31 - 1)),
                "sync_batchnorm": self.options.sync_batchnorm,
                "lr_scale": lr_scale,
                "hooks": sorted(driver.hooks),
                "epoch_weights": driver.needs_weights,
                "rnn_states": _states_of(template),
                "reset_states": self._resets_states(template),
            }
            try:
                results = _states_back(template, pool.call([payload] * pool.world,
                                                           on_event=driver))
            except BaseException:
                pool.model_key = None
                if method == "fit":
                    _restore(template, state, info)
                raise
            pool.model_key = key
            timing("call")
            out = self._finish(method, template, results, driver,
                               lambda: _restore(template, state, info))
            timing("state back")
            timing.report()
            return out
        finally:
            files.close()

    def _finish(self, method, template, results, driver, load_final):
        """The call's return value, once every rank has answered."""
        if driver.error is not None or any(isinstance(r, dict) and r.get("aborted")
                                           for r in results[:1]):
            if method == "fit":
                load_final()  # the last consistent state (epoch snapshot)
            if driver.error is not None:
                raise driver.error
            raise RuntimeError("kmgpu: the call was aborted")
        if method == "fit":
            if not driver.final_loaded:
                load_final()
            template.history = driver.history
            return driver.history
        if method == "predict":
            return _assemble(results)
        return results[0]

    # -- in-process mode ------------------------------------------------------------
    def _init_in_process(self, available):
        import torch
        import torch.distributed as dist

        from kmgpu import environment

        gpu = torch.cuda.is_available() and not environment.simulated_count()
        if gpu:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if gpu else "gloo", init_method="env://")
            self._owns_group = True
            atexit.register(self._end_group)  # no gloo/NCCL abort at exit
        self.backend = dist.get_backend()
        world = dist.get_world_size()
        kind = "gpu" if gpu else "cpu"
        self.device_ids = list(range(world))
        self.device_names = [f"{kind}:{r}" for r in range(world)]
        self.torch_devices = None
        self.name = (f"torch DistributedDataParallel ({self.backend}, in-process: rank "
                     f"{dist.get_rank()} of {world})")
        from kmgpu.engines.torch import rank as _torch_rank

        device = f"cuda:{torch.cuda.current_device()}" if gpu else "cpu"
        self._ctx = _torch_rank.RankContext(device, self.options.sync_batchnorm)

    def _run_here(self, method, template, kwargs, lr_scale):
        import torch.distributed as dist

        from kmgpu.engines.torch import rank as _torch_rank

        ctx = self._ctx
        kwargs = dict(kwargs)
        callbacks = kwargs.pop("callbacks", None)
        key = _model_key(template, self.options.sync_batchnorm, lr_scale)
        if self._replica is None or key != self._built_key:
            fixed = models.fixed_batch(template)
            replica = (models.clone(template) if fixed is None
                       else models.clone_at(template, fixed // ctx.world))
            if template.compiled:
                args = (models.compile_args(template) if lr_scale == (1.0, 0)
                        else models.compile_args(template, lr_scale))
                replica.compile(**args)
            self._replica, self._built_key = _torch_rank.prepare(replica, ctx), key
        replica = self._replica
        models.copy_state(template, replica)
        _copy_lr(template, replica)
        _torch_rank.broadcast_state(replica, ctx)
        _torch_rank.write_state_rows(replica, _states_of(template), ctx)

        def load_state():
            models.copy_state(replica, template)
            _copy_lr(replica, template)

        # Rank 0 runs the user's callbacks, with the user's model; the others
        # learn which hooks that takes (and the shuffling seed) from it.
        def push_state():
            models.copy_state(template, replica)
            _copy_lr(template, replica)

        driver = CallbackDriver(callbacks if ctx.rank == 0 else None, template, method,
                                load_state=load_state, push_state=push_state)
        shared = [sorted(driver.hooks), int(np.random.randint(0, 2**31 - 1))]
        dist.broadcast_object_list(shared, 0)
        kwargs = {k: (_local(v) if k in ("x", "y", "sample_weight", "validation_data") else v)
                  for k, v in kwargs.items()}
        try:
            result = _torch_rank.run(replica, ctx, method, kwargs, seed=shared[1],
                                     hooks=shared[0], relay=driver if ctx.rank == 0 else None,
                                     reset_states=self._resets_states(template))
        except BaseException:
            if method == "fit":
                load_state()
            raise
        if models.stateful_layers(template):  # every rank's rows, in rank order, on every template
            rows = [None] * ctx.world
            dist.all_gather_object(rows, _torch_rank.state_rows(replica))
            _states_back(template, [{"result": None, "states": r} for r in rows])
        aborted = [bool(isinstance(result, dict) and result.get("aborted"))]
        if method == "fit":
            box = [result, None]
            if ctx.rank == 0 and driver.history is not None:
                h = driver.history
                box[1] = {"history": h.history, "params": h.params, "epoch": h.epoch}
            dist.broadcast_object_list(box, 0)
            result = box[0]
            if ctx.rank != 0 and box[1] is not None and not result:
                driver.history = _history(template, box[1])
        if method == "predict" and not aborted[0]:
            pieces = [None] * ctx.world
            dist.all_gather_object(pieces, result)
            result = pieces
        else:
            result = [result]
        return self._finish(method, template, result, driver, load_state)


class _Timing:
    """KMGPU_TORCH_TIMING=1: print where a pool call's time went, in this process."""

    def __init__(self):
        import time

        self.on = bool(os.environ.get("KMGPU_TORCH_TIMING"))
        self.clock = time.perf_counter
        self.t, self.parts = self.clock(), []

    def __call__(self, name):
        now = self.clock()
        self.parts.append((name, now - self.t))
        self.t = now

    def report(self):
        if self.on:
            print("kmgpu parent timing: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.parts),
                  flush=True)


class CallbackDriver:
    """Runs the user's callbacks once, with the user's own model, as rank 0 relays hooks.

    Called as ``driver(hook, index, logs, params)``. The callbacks get one logs
    dict in turn, as in Keras's CallbackList; a fit's ``History`` comes last, so
    it records what they added (a learning rate, say), and the reply carries the
    logs back so rank 0's progress bar shows them too. The reply also carries
    whether to stop and the learning rate, or {"abort": True} once a callback
    has raised: the exception is kept in ``error`` and raised by the engine after
    every rank has left the call, so the worker pool stays usable.
    KeyboardInterrupt propagates: the engine then kills the workers, like a
    Ctrl-C anywhere else in the call. Before ``on_train_end``, and before
    ``on_epoch_end`` unless every callback is known to leave the weights alone
    (``_weight_free``), it loads rank 0's latest state into the model, so a
    checkpoint or early-stopping callback sees current weights.
    """

    def __init__(self, callbacks, template, method, load_state, push_state=None):
        import keras

        from kmgpu.engines.torch import rank as _torch_rank

        self.template, self.load_state, self.push_state = template, load_state, push_state
        self.error, self.final_loaded, self._params = None, False, None
        callbacks = list(callbacks or [])
        hooks = _torch_rank.implemented_hooks(callbacks)
        family = {"fit": _torch_rank.TRAIN_HOOKS, "evaluate": _torch_rank.TEST_HOOKS,
                  "predict": _torch_rank.PREDICT_HOOKS}[method]
        if method == "fit":  # fit's validation runs the test hooks too
            family = family + _torch_rank.TEST_HOOKS
            hooks |= {"on_train_begin", "on_epoch_end"}  # the History lives here
        hooks &= set(family)
        # A begin hook and its end hook travel together (Keras's CallbackList counts them).
        for prefix, hooks_of in (("on_train", _torch_rank.TRAIN_HOOKS),
                                 ("on_test", _torch_rank.TEST_HOOKS),
                                 ("on_predict", _torch_rank.PREDICT_HOOKS)):
            if hooks & set(hooks_of):
                hooks |= {prefix + "_begin", prefix + "_end"}
        self.hooks = hooks
        # Rank 0 saves a snapshot and this side loads it at every epoch end only
        # when a callback here may look at the weights.
        self.needs_weights = any(
            not _weight_free(cb) and "on_epoch_end" in _torch_rank.implemented_hooks([cb])
            for cb in callbacks)
        # ... and sends the model's state back to the ranks after on_train_begin when a
        # callback may have set it there (BackupAndRestore restores weights + epoch).
        self.may_set_weights = any(
            not _weight_free(cb) and "on_train_begin" in _torch_rank.implemented_hooks([cb])
            for cb in callbacks)
        self.callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=(method == "fit"), model=template)
        self.history = self.callbacks._history

    def __call__(self, hook, index, logs, params):
        import keras

        if self.error is not None:
            return {"abort": True}
        logs = dict(logs) if isinstance(logs, dict) else logs
        try:
            if params and params != self._params:
                self.callbacks.set_params(params)
                self._params = params
            if hook == "on_train_end" or (hook == "on_epoch_end" and self.needs_weights):
                self.load_state()
                self.final_loaded = hook == "on_train_end"
            if hook == "on_train_begin":
                self.template.stop_training = False
            for callback in self.callbacks.callbacks:
                fn = getattr(callback, hook)
                fn(logs) if index is None else fn(index, logs)
        except KeyboardInterrupt:
            raise  # Ctrl-C: the engine stops every worker now
        except BaseException as e:
            self.error = e  # the workers leave the call together; the engine raises it
            return {"abort": True}
        reply = {}
        if hook == "on_train_begin":
            # Keras's fit starts at model._initial_epoch when a callback set it
            reply["initial_epoch"] = getattr(self.template, "_initial_epoch", None)
            if self.may_set_weights and self.push_state is not None:
                self.push_state()
                reply["reload"] = True
        lr = getattr(getattr(self.template, "optimizer", None), "_learning_rate", None)
        return dict(reply, stop=bool(getattr(self.template, "stop_training", False)),
                    lr=float(lr.numpy()) if isinstance(lr, keras.Variable) else None,
                    logs=logs)


# -- helpers ------------------------------------------------------------------------
def _weight_free(callback):
    """Callbacks known to read only logs and the learning rate, never the weights."""
    import keras

    cbs = keras.callbacks
    if isinstance(callback, cbs.EarlyStopping):
        return not callback.restore_best_weights
    if isinstance(callback, (cbs.History, cbs.ProgbarLogger, cbs.CSVLogger,
                             cbs.LearningRateScheduler, cbs.ReduceLROnPlateau,
                             cbs.TerminateOnNaN, cbs.RemoteMonitor)):
        return True
    return type(callback).__module__ == "kmgpu.lr"  # kmgpu's learning-rate scaling


def close_pools():
    """Close every worker pool (engines start a new one when next needed)."""
    while _SHARED_POOLS:
        _SHARED_POOLS.pop(next(iter(_SHARED_POOLS))).close()


def _worker_settings(backend):
    import keras

    from kmgpu import environment

    env = {"KERAS_BACKEND": "torch"}
    # one host: the workers talk over loopback only (the store listens on 127.0.0.1
    # too), whatever interface the environment names for multi-host jobs
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env["GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"] = loopback
    if environment.simulated_count():
        env[environment.SIMULATE_ENV] = str(environment.simulated_count())
    config = {
        "floatx": keras.config.floatx(),
        "epsilon": keras.config.epsilon(),
        "image_data_format": keras.config.image_data_format(),
        "dtype_policy": keras.config.dtype_policy().name,
    }
    return {"env": env, "keras_config": config, "sync_batchnorm": False}


def _is_array_like(x):
    if x is None or isinstance(x, np.ndarray) or hasattr(x, "__array__"):
        return True
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return True
    if isinstance(x, (list, tuple, dict)):
        import keras

        return all(_is_array_like(leaf) or np.isscalar(leaf) for leaf in keras.tree.flatten(x))
    return False


def _check_data(name, x):
    import keras

    if isinstance(x, keras.utils.PyDataset) or _is_array_like(x):
        return
    raise TypeError(
        f"kmgpu (torch): {name} is a {type(x).__name__}. kmgpu's torch workers take NumPy "
        "arrays (or torch tensors, lists/dicts of them) or a keras.utils.PyDataset, which "
        "each worker slices batch by batch. Convert the data to arrays, wrap it in a "
        "PyDataset, or run the script under torchrun (each process then passes its data)."
    )


def _ship(kwargs, files):
    import keras

    out = dict(kwargs)
    for key in ("x", "y", "sample_weight", "validation_data"):
        value = kwargs.get(key)
        if value is None:
            continue
        _check_data(key, value)
        if isinstance(value, keras.utils.PyDataset):
            out[key] = _ship_dataset(value, files)
        else:
            out[key] = files.put(tuple(value) if key == "validation_data" else value)
    return out


PICKLE_LIMIT = 16 << 20


def _ship_dataset(dataset, files):
    """A PyDataset for the workers: pickled (by reference, or by value with
    cloudpickle) when that works and is small; else read here once and stored as
    memory-mapped arrays (``_torch_rank.StoredBatches``)."""
    import pickle

    import keras

    from kmgpu.engines.torch import pool as _torch_pool, rank as _torch_rank

    try:
        blob = _torch_pool.dumps(dataset)
        if len(blob) <= PICKLE_LIMIT:
            return blob
    except Exception:
        pass
    batches = []
    for i in range(len(dataset)):
        batch = dataset[i]
        batches.append(tuple(batch) if isinstance(batch, (tuple, list)) else (batch,))
    bounds = [0]
    for batch in batches:
        bounds.append(bounds[-1] + int(keras.tree.flatten(batch[0])[0].shape[0]))
    parts = keras.tree.map_structure(
        lambda *leaves: None if leaves[0] is None else np.concatenate(
            [_torch_pool._as_array(leaf) for leaf in leaves]), *batches)
    return pickle.dumps(_torch_rank.StoredBatches(files.put(parts), bounds))


def _local(value):
    """In-process: torch tensors / array-likes as NumPy (PyDatasets untouched)."""
    import keras

    from kmgpu.engines.torch.pool import _as_array

    if value is None or isinstance(value, keras.utils.PyDataset):
        return value
    _check_data("data", value)
    return keras.tree.map_structure(_as_array, value)


def _nbytes(kwargs):
    import keras

    total = 0
    for key in ("x", "y", "sample_weight", "validation_data"):
        value = kwargs.get(key)
        if value is None or isinstance(value, (bytes, keras.utils.PyDataset)):
            continue
        try:
            for leaf in keras.tree.flatten(value):
                total += int(getattr(leaf, "nbytes", 0) or 0)
        except Exception:
            pass
    return total


def _template_state(template, with_optimizer):
    import keras

    arrays = list(template.get_weights())
    n_weights = len(arrays)
    n_opt, has_lr = 0, False
    opt = getattr(template, "optimizer", None)
    if with_optimizer and opt is not None:
        if not opt.built:
            opt.build(template.trainable_variables)
        ostate = [v.numpy() for v in models.optimizer_state(opt)]
        arrays += ostate
        n_opt = len(ostate)
        lr = getattr(opt, "_learning_rate", None)
        if isinstance(lr, keras.Variable):
            arrays.append(np.asarray(lr.numpy()))
            has_lr = True
    arrays = [np.asarray(a) for a in arrays]
    info = {"layout": [(a.shape, a.dtype.str) for a in arrays], "n_weights": n_weights,
            "n_optimizer": n_opt, "has_lr": has_lr}
    return info, arrays


def _restore(template, state, info):
    """The newest complete snapshot rank 0 wrote (final weights, or the last epoch's)."""
    latest = state.latest()
    if latest is None:
        return False
    arrays, _ = latest
    nw, no = info["n_weights"], info["n_optimizer"]
    template.set_weights(arrays[:nw])
    opt = getattr(template, "optimizer", None)
    if no and opt is not None:
        for v, a in zip(models.optimizer_state(opt), arrays[nw:nw + no]):
            v.assign(a)
    if info["has_lr"] and opt is not None:
        opt._learning_rate.assign(arrays[-1])
    return True


def _states_of(template):
    """The template's stateful RNN states, all B rows each (empty list: none)."""
    import keras

    return [keras.ops.convert_to_numpy(v.value) for v in models.state_variables(template)]


def _states_back(template, answers):
    """The ranks' results, once their stateful RNN rows are in the template, rank order."""
    rows = [a["states"] for a in answers]
    for i, v in enumerate(models.state_variables(template)):
        v.assign(np.concatenate([r[i] for r in rows]))
    return [a["result"] for a in answers]


def _copy_lr(src, dst):
    import keras

    a = getattr(getattr(src, "optimizer", None), "_learning_rate", None)
    b = getattr(getattr(dst, "optimizer", None), "_learning_rate", None)
    if isinstance(a, keras.Variable) and isinstance(b, keras.Variable) and a is not b:
        b.assign(a.numpy())


def _history(template, result):
    import keras

    history = keras.callbacks.History()
    history.set_model(template)
    history.history = result["history"]
    history.params = result["params"]
    history.epoch = result["epoch"]
    template.history = history
    return history


def _assemble(pieces):
    """Predictions in input order from every rank's (positions, predictions)."""
    import keras

    n = sum(len(where) for where, _ in pieces)
    first = pieces[0][1]
    flats = [keras.tree.flatten(out) for _, out in pieces]
    outputs = []
    for j, leaf in enumerate(flats[0]):
        leaf = np.asarray(leaf)
        full = np.empty((n,) + leaf.shape[1:], leaf.dtype)
        for (where, _), flat in zip(pieces, flats):
            full[where] = flat[j]
        outputs.append(full)
    return keras.tree.pack_sequence_as(first, outputs)


def _model_key(template, sync_batchnorm, lr_scale=(1.0, 0)):
    config = json.dumps(template.get_config(), sort_keys=True, default=repr)
    compile_config = json.dumps(template.get_compile_config(), sort_keys=True, default=repr) \
        if template.compiled else "null"
    return f"{type(template).__module__}.{type(template).__qualname__}|{config}|" \
           f"{compile_config}|sync_bn={sync_batchnorm}|lr_scale={lr_scale}"


def _custom_objects(template):
    """The classes and functions outside Keras that the model's config and its
    compile() need: its layer classes, the objects its compile arguments hold and
    whatever registered objects its serialized configs name (schedules,
    initializers, regularizers...)."""
    import keras

    custom = {}

    def add(obj):
        cls = obj if isinstance(obj, type) or not hasattr(obj, "get_config") else type(obj)
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("keras") or module == "builtins" or not callable(cls):
            return
        try:
            name = keras.saving.get_registered_name(cls)
        except Exception:
            name = getattr(cls, "__name__", None)
        if name:
            custom[name] = cls
            custom.setdefault(getattr(cls, "__name__", name), cls)

    def walk(node):
        if isinstance(node, dict):
            module, name = node.get("module"), node.get("registered_name")
            if isinstance(module, str) and isinstance(name, str) and \
                    not module.startswith("keras") and name != "function":
                obj = keras.saving.get_registered_object(name)
                if obj is not None:
                    add(obj)
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    for layer in template._flatten_layers(include_self=True):
        add(layer)
    walk(keras.saving.serialize_keras_object(template))
    if template.compiled:
        config = template._compile_config.config
        for key in ("optimizer", "loss", "metrics", "weighted_metrics", "loss_weights"):
            value = config.get(key)
            if value is None or isinstance(value, str):
                continue
            for leaf in keras.tree.flatten(value):
                if leaf is not None and not isinstance(leaf, (str, int, float)):
                    add(leaf)
        walk(template.get_compile_config())
    return custom


def _model_spec(template):
    """The model as config (+ compile config and custom objects), and whether the
    custom objects could not be pickled (a class defined inside a function, or in
    a notebook without cloudpickle): then forked workers must inherit them."""
    import pickle

    import keras

    from kmgpu.engines.torch import pool as _torch_pool

    serialized = keras.saving.serialize_keras_object(template)
    serialized.pop("compile_config", None)
    custom = _custom_objects(template)
    try:
        blob = _torch_pool.dumps(custom)
        pickle.loads(blob)
    except Exception:
        blob = None
    spec = {
        "model": serialized,
        "build_config": template.get_build_config(),
        "compile": template.get_compile_config() if template.compiled else None,
        "custom_objects": blob,
    }
    if blob is None:
        _torch_pool.INHERITED["custom_objects"] = custom
    return spec, blob is None


"""How the torch ranks' processes come to exist, and how a call and its state reach them.

As Lightning Fabric keeps launchers apart from strategies, the torch engine holds one
launcher; what each rank runs is ``strategy.DDPStrategy`` either way, made by one route:
the run's ``Config`` travels in every ``messages.Call`` and the rank makes its strategy
from it, ``DDPStrategy(device, call.config)``, when it makes a replica for the call's key
(a pool worker from the pickled Call, an in-process rank from the Call itself).

- ``PoolLauncher``: kmgpu starts one worker process per device (gloo on CPU and
  simulated devices, NCCL on GPUs) and reuses it between calls and engines
  (``pool.WorkerPool``). The model travels as config, the data once as
  memory-mapped files, the state through the pool's state file (under
  shard="weights" over the pipes: ``state_pipe``); rank 0's progress bar streams to
  this process's stdout.
- ``InProcessLauncher`` (``in_process``): torchrun (or ``kmgpu launch``, or the user's own
  ``init_process_group``) already started this process as one rank. DDP runs
  here; every process passes the same full data; the user's callbacks run on
  rank 0 only and every rank returns the same History, metrics and predictions.

``choose`` picks one; the engine drives both through the same methods (``base.Launcher``).
"""

import dataclasses
import os
import sys
import warnings

from kmgpu.engines.base import ON_BATCH
from kmgpu.engines.torch import replicas, transport
from kmgpu.engines.torch.data import inputs
from kmgpu.engines.torch.launch import held_slots, state_pipe
from kmgpu.engines.torch.launch.base import Launcher
from kmgpu.engines.torch.launch.in_process import InProcessLauncher
from kmgpu.engines.torch.launch.messages import WeightsQuery
from kmgpu.engines.torch.launch.pool import WorkerPool, start_method

_SHARED_POOLS = {}  # (devices, backend) -> WorkerPool, reused by every engine on them
MAX_POOLS = 2  # live pools kept; the least recently used beyond that is closed


def in_distributed_job():
    """True when this process is one rank of a job (torch.distributed or torchrun env)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def choose(config):
    """The launcher for this process: in-process inside a distributed job, else a pool.

    Args:
        config: the run's ``Config`` (a pool starts a worker on each of its devices).

    Returns:
        An InProcessLauncher or a PoolLauncher.
    """
    if in_distributed_job():
        return InProcessLauncher()
    return PoolLauncher(config)


def close_pools():
    """Close every worker pool (engines start a new one when next needed)."""
    while _SHARED_POOLS:
        _SHARED_POOLS.pop(next(iter(_SHARED_POOLS))).close()


class PoolLauncher(Launcher):
    """kmgpu's worker pool: one process per device, shared by engines on the same devices.

    Args:
        config: the run's ``Config``: its devices.
    """

    is_interactive_compatible = True  # workers stream to the running cell

    def __init__(self, config):
        gpu = config.devices[0][0] == "gpu"
        self.device_ids = list(config.device_ids)
        self.device_names = config.device_names
        self.torch_devices = [f"cuda:{i}" if gpu else "cpu" for _, i in config.devices]
        self.backend = "nccl" if gpu else "gloo"
        self.name = (f"torch DistributedDataParallel ({self.backend}, "
                     f"{len(self.device_ids)} worker process(es), reused between calls)")
        self.pool = None
        self._files = None
        self._state = None  # (StateFile, StateLayout) once this call's state is written
        self._pipe = None  # shard="weights": the call's state over the pipes (DriverPipe)
        self._feed = None  # fit's training data read pass by pass (feeds.Feed)
        # the template's state as the workers' replicas hold it: (pool, token, versions,
        # layout) after a call that left them equal; the next call sends no state
        # while the template's tensors are unchanged (``unchanged``)
        self._synced = None
        self._candidate = None  # (versions, layout) of this call, once they are equal
        self._held = held_slots.HeldSlots(self)  # shard="weights": the slots the ranks keep
        self.in_call = False

    @property
    def _key(self):
        return (tuple(self.torch_devices), self.backend)

    def _ensure_pool(self):
        settings = _worker_settings(self.backend)
        pool = _SHARED_POOLS.pop(self._key, None)
        if pool is not None and pool.settings.get("keras_config") != settings["keras_config"]:
            # started under other global Keras settings (a dtype policy set since, e.g.
            # mixed_float16 in a notebook after a first fit): its workers would build
            # and compile the replica under those (no LossScaleOptimizer, other dtypes)
            pool.close()
            pool = None
        if pool is None or not pool.alive():
            if pool is not None:
                pool.kill()
            while len(_SHARED_POOLS) >= MAX_POOLS:
                _SHARED_POOLS.pop(next(iter(_SHARED_POOLS))).close()
            pool = WorkerPool(self.torch_devices, self.backend, settings).start()
        _SHARED_POOLS[self._key] = pool  # most recently used last
        self.pool = pool
        return pool

    def _fork_next(self, names):
        """Custom objects that cannot be pickled (``names``) reach workers forked after
        they exist."""
        if start_method(self.torch_devices[0].startswith("cuda")) != "fork":
            raise TypeError(
                f"kmgpu (torch): {', '.join(names) or 'the model'} cannot be sent to the "
                "spawned worker processes (pickled by value). Move what holds an open file, "
                "a lock or a connection out of the model and its losses and metrics, or "
                "define the class in an importable module.")
        pool = _SHARED_POOLS.pop(self._key, None)
        if pool is not None:
            pool.close()  # the next pool is forked now, with the objects in memory

    def launch(self, call, template, driver, clock):
        pool = _SHARED_POOLS.get(self._key)
        spec = None
        if pool is None or not pool.alive() or pool.model_key != call.key:  # a new pool needs it
            spec, inherit = replicas.model_spec(template)
            if inherit:
                self._fork_next(replicas.unpicklable(transport.INHERITED["objects"]))
        synced = self._synced
        pool = self._ensure_pool()
        state_in = not (synced is not None and synced[0] is pool and pool.synced is synced[1]
                        and pool.model_key == call.key and replicas.unchanged(template, synced[2]))
        holder = pool.holder
        if holder is not None and (holder is not self._held or state_in or call.slots_back):
            # the ranks are about to take other state, or the callbacks may read it
            holder.fetch()
            synced = self._synced
        clock("pool")
        if call.method in ON_BATCH:  # one batch: through the pipe, no files
            kwargs = {k: inputs.as_numpy(v) if k in inputs.DATA_KEYS else v
                      for k, v in call.kwargs.items()}
        else:
            self._files = transport.CallFiles(inputs.nbytes(call.kwargs))
            kwargs, self._feed = inputs.send(call.kwargs, self._files, call.method, template)
        clock("data out")
        pool.synced = None  # until this call has left the replicas equal to the template
        # shard="weights": the state over the pipes, no whole copy of it in a file
        piped = call.config.shard == "weights"
        absent = ()
        if state_in:
            layout = replicas.layout_of(template, with_optimizer=True)
            state = pool.state_file(state_pipe.file_layout(piped, layout))
            if piped:  # the ranks ask for their pieces; a new optimizer's zeros stay here
                absent, zeros = replicas.zero_slots(template, layout)
            else:  # each variable copied once, straight into the file (no whole copy first)
                zeros = replicas.write_state(state, 0, template, layout, zeros_out=True)
            if zeros and not call.slots_back and piped:
                # a new optimizer's slots: the ranks make them (pieces, or rank 0 whole
                # where its step keeps them so; the other shard values keep them on no
                # rank whole between calls)
                self._held.hold(template, layout, zeros, pool)
        else:  # the replicas hold this state already
            layout = synced[3]
            state = pool.state_file(state_pipe.file_layout(piped, layout))
        self._candidate = (replicas.state_versions(template), layout)
        self._state = (state, layout)
        self._pipe = state_pipe.DriverPipe(template, layout) if piped else None
        self.copied_in = len(layout.arrays) if state_in else 0
        self.in_call = True
        clock("state out")
        call = dataclasses.replace(call, kwargs=kwargs, state_path=state.path, layout=layout,
                                   model=None if pool.model_key == call.key else spec,
                                   state_in=state_in, piped=piped, absent=absent)
        stop = state.request_stop if call.method == "fit" else None
        try:
            answers = pool.call([call] * pool.world, on_event=driver, on_interrupt=stop,
                                on_state=self._pipe)
        except BaseException:
            # a Ctrl-C the workers answered leaves them and their replicas as they were
            pool.model_key = call.key if pool.alive() else None
            raise
        pool.model_key = call.key
        clock("call")
        return answers

    def load_state(self, template):
        """The newest complete snapshot the ranks wrote (final weights, or the last
        epoch's) into ``template``; False when there is none."""
        if self._pipe is not None:
            return self._piped_state(template)
        # views of the file: set_weights / assign copy them into the variables at once
        latest = self._state[0].latest(copy=False) if self._state is not None else None
        if latest is None:
            return False
        arrays, layout = latest[0], self._state[1]
        self._held.replaced_by([a is not None for a in arrays])
        missing = replicas.load_arrays(template, arrays, layout)
        if missing:  # the optimizer's slots the ranks keep (shard="weights")
            self._held.hold(template, layout, missing, self.pool)
        self._candidate = (replicas.state_versions(template), layout)  # rank 0's, as loaded
        return True

    def _piped_state(self, template):
        """``load_state`` over the pipes: the snapshots are in ``template`` already, as the
        ranks sent them (``state_pipe``); the slots they left out are held."""
        pipe, layout = self._pipe, self._state[1]
        if pipe.partial:
            warnings.warn(
                "kmgpu (torch): a worker process ended while the ranks sent their state back; "
                "your model holds the parts that came and its earlier state elsewhere. "
                "Load your last checkpoint (kmgpu.ShardedCheckpoint) before going on.",
                RuntimeWarning, stacklevel=4)
        if not pipe.complete:
            return False
        missing = set(pipe.complete[-1][2])
        self._held.replaced_by([i not in missing for i in range(len(layout.arrays))])
        if missing:  # the optimizer's slots the ranks keep
            variables = replicas.transfer_variables(template, layout)
            self._held.hold(template, layout, [variables[i] for i in sorted(missing)],
                            self.pool)
        self._candidate = (replicas.state_versions(template), layout)
        return True

    def push_state(self, template):
        if self._pipe is not None:
            return  # the ranks read your model as it is when they reload
        state, layout = self._state
        replicas.write_state(state, 0, template, layout)

    def end_call(self, failed, touched=False):
        self.in_call = False
        self._synced = None
        candidate, self._candidate = self._candidate, None
        if not failed and not touched and candidate is not None and self.pool is not None \
                and not self.pool.closed:
            token = object()
            self.pool.synced = token  # another engine's call on this pool clears it
            self._synced = (self.pool, token) + candidate
        if self._state is not None and self.pool is not None and not self.pool.closed:
            try:  # loaded into the template: the file keeps no state between calls
                self._state[0].free()
            except OSError:  # the pool's file is gone with it
                pass
        files, self._files, self._state, self._pipe = self._files, None, None, None
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()
        if files is not None:
            files.close()

    def rank_weights(self):
        return self.pool.call([WeightsQuery()] * self.pool.world)

    def rank_held_bytes(self):
        return self.pool.call([WeightsQuery("held")] * self.pool.world)

    def worker_pids(self):
        return [] if self.pool is None or self.pool.closed else self.pool.pids

    def close(self):
        pool, self.pool = self.pool, None
        if pool is not None:
            if _SHARED_POOLS.get(self._key) is pool:
                del _SHARED_POOLS[self._key]
            pool.close()


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
    return {"env": env, "keras_config": config,
            "timeout": environment.collective_timeout().total_seconds()}

"""The launcher for a process that is already one rank (torchrun, ``kmgpu launch``, or the
user's own process group): ``InProcessLauncher``, the replica lives here (``launchers``
says how it differs from the worker pool)."""

from kmgpu.engines import replication
from kmgpu.engines.torch import collectives, replicas, runtime
from kmgpu.engines.torch.data import feeds, inputs, shuffle
from kmgpu.engines.torch.launch import relay
from kmgpu.engines.torch.launch.base import Launcher
from kmgpu.engines.torch.launch.messages import Aborted, RankResult
from kmgpu.engines.torch.strategy import DDPStrategy


class InProcessLauncher(Launcher):
    """This process is already one rank (torchrun, ``kmgpu launch``, or the user's own
    process group): nothing to start; the replica lives here.

    Joins the group from torchrun's variables when the user has not
    (``runtime.join_group``; left together at exit or at this launcher's ``close``).
    Keeps one replica, and the strategy it was made with, between calls.
    """

    def __init__(self):
        import torch.distributed as dist

        gpu, self.device, self._owns_group = runtime.join_group()
        self.backend = dist.get_backend()
        world = dist.get_world_size()
        kind = "gpu" if gpu else "cpu"
        self.device_ids = list(range(world))
        self.device_names = [f"{kind}:{r}" for r in range(world)]
        self.name = (f"torch DistributedDataParallel ({self.backend}, in-process: rank "
                     f"{dist.get_rank()} of {world})")
        self.runs_callbacks = dist.get_rank() == 0
        self.strategy = None  # made with each replica, from the call's config
        self.replica, self._built_key = None, None
        self._live = False  # the replica holds this call's state
        self._synced = None  # (replica, versions) after a call that left them equal
        self._candidate = None

    def _replica_for(self, call, template):
        if self.replica is None or call.key != self._built_key:
            self.replica, self._built_key = None, None
            # each process's own model gets a sharded optimizer state: gathered everywhere
            strategy = DDPStrategy(self.device, call.config, gather_everywhere=True)
            self.strategy = strategy
            with strategy.building():  # shard="weights": in host memory, pieces to the device
                replica = replication.make_replica(
                    template, rows=lambda batch: batch // strategy.world,
                    lr_scale=call.lr_scale, finish=strategy.prepare)
            self.replica, self._built_key = replica, call.key
        return self.replica

    def launch(self, call, template, driver, clock):
        replica = self._replica_for(call, template)
        s = self.strategy  # the one this replica was made with
        synced = self._synced
        state_in = not (synced is not None and synced[0] is replica
                        and replicas.unchanged(template, synced[1]))
        # the others learn which hooks rank 0's callbacks take, its random states (the
        # same order everywhere) and whether its template's state must reach the
        # replicas (rank 0's decides)
        hooks, rng, state_in = collectives.broadcast_object((call.hooks, call.rng, state_in))
        shuffle.set_state(rng)
        if state_in:  # every rank's template into its replica; rank 0's wins
            self.push_state(template)
            s.receive_state(replica, None, shared=False)
        self._candidate = replicas.state_versions(template)
        self.copied_in = len(self._candidate) if state_in else 0
        s.write_state_rows(replica, call.rnn_states)
        clock("replica")
        host = feeds.KerasDraws()  # from the random states every rank now shares
        kwargs = inputs.local(call.kwargs, call.method, template, host)
        self._live = True
        before = None if call.method in ("fit", "train_on_batch") else \
            replicas.state_versions(replica)
        result = s.run(replica, call.method, kwargs, hooks=hooks,
                       relay=driver if s.rank == 0 else None, reset_states=call.reset_states,
                       fit_callbacks=[feeds.NextPass(kwargs.get("x"),
                                                     kwargs.get("validation_data"))])
        host.leave_as_keras()  # where plain Keras's reads leave torch's random state
        rows = [[]] * s.world
        if replication.stateful_layers(template):  # every rank's rows, in rank order, everywhere
            rows = collectives.all_gather_object(s.state_rows(replica))
        if call.method == "fit":  # rank 0's History on every rank
            record = None
            if s.rank == 0 and driver.history is not None:
                record = relay.record(driver.history)
            result, record = collectives.broadcast_object((result, record))
            if s.rank != 0 and record is not None and result is None:
                driver.history = relay.history_from(template, record)
        results = [result] + [None] * (s.world - 1)
        if call.method in ("predict", "predict_on_batch") and not isinstance(result, Aborted):
            results = collectives.all_gather_object(result)
        touched = [False] * s.world
        if before is not None:  # a custom step may assign variables in a call that tests
            touched = collectives.all_gather_object(not replicas.unchanged(replica, before))
        clock("call")
        return [RankResult(r, states, s.last_rows, t)
                for r, states, t in zip(results, rows, touched)]

    def load_state(self, template):
        if not self._live:
            return False
        replication.copy_state(self.replica, template)
        replication.copy_lr(self.replica, template)
        self._candidate = replicas.state_versions(template)
        return True

    def push_state(self, template):
        self.strategy.receivable()  # shard="weights": host buffers to copy into
        replication.copy_state(template, self.replica)
        replication.copy_lr(template, self.replica)

    def end_call(self, failed, touched=False):
        self._live = False
        candidate, self._candidate = self._candidate, None
        self._synced = (None if failed or touched or candidate is None
                        else (self.replica, candidate))
        if failed:  # process-wide: the group may be another model's (the first made here)
            runtime.mark_broken()

    def rank_weights(self):
        return collectives.all_gather_object(self.replica.get_weights())

    def rank_held_bytes(self):
        return collectives.all_gather_object(self.strategy.held_bytes())

    def close(self):
        if self._owns_group:
            self._owns_group = False
            runtime.leave_group()

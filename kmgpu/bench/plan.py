"""Which runs ``kmgpu bench`` makes, in which order, and whether the time budget still
allows the next one.

Runs come in three tiers, each over every workload before the next tier starts, so a
run cut short by ``--budget`` loses the least useful figures first (with one process per
workload, the worker starts no tier-1/2 run after its share of the time left):
    0  plain fit on 1 device; kmgpu on all devices, batch policies global and per_replica
       (the speedup table)
    1  the peer on all devices (global); kmgpu on 1 device; the all-reduce sweep
       (kmgpu / peer, overhead, the projection's bandwidth)
    2  the peer per_replica and on 1 device; the pure-framework reference; plain fit
       again (noise); device counts between 1 and all
With one device the two policies are the same run: per_replica runs only for N > 1.
``lean`` (``--lean``, and ``--quick``) leaves out the peer's tier-2 runs (per_replica, and
on one device): the code they run is the peer's at the top count.
"""

import time

RUNNERS = ("plain", "kmgpu", "peer", "reference", "allreduce")
POLICIES = ("global", "per_replica")
SWEEP_BACKENDS = ("jax", "torch")
REFERENCE = {"torch": ("resnet50", "resnet50_small")}


def plan(backends, names, counts, replay=False, policies=POLICIES, runners=RUNNERS,
         lean=False):
    """The runs, as dicts {backend, workload, runner, devices, policy}, in order: per
    backend, by tier, then workload (see the module docstring)."""
    top = max(counts)
    runs = []
    for b, backend in enumerate(backends):
        tiered = []

        def add(tier, w, runner, n, policy="global", workload=None):
            wanted = runner in runners or runner == "replay"  # replay: its own switch
            if wanted and (policy in policies or runner == "allreduce"):
                tiered.append(((b, tier, w, len(tiered)), {
                    "backend": backend, "workload": workload or names[w], "runner": runner,
                    "devices": n, "policy": policy, "tier": tier}))

        for w, name in enumerate(names):
            add(0, w, "plain", 1)
            if top > 1:
                add(0, w, "kmgpu", top, "global")
                add(0, w, "kmgpu", top, "per_replica")
                add(1, w, "peer", top, "global")
            if 1 in counts:
                add(1, w, "kmgpu", 1)
            if top > 1 and not lean:
                add(2, w, "peer", top, "per_replica")
            if 1 in counts and not lean:
                add(2, w, "peer", 1)
            if name in REFERENCE.get(backend, ()):
                add(2, w, "reference", 1)
            if replay:
                add(2, w, "replay", 1)
            for n in counts:
                if 1 < n < top:
                    for runner in ("kmgpu", "peer"):
                        for policy in POLICIES:
                            add(2, w, runner, n, policy)
        if top > 1 and backend in SWEEP_BACKENDS:
            add(1, len(names), "allreduce", top, workload="allreduce")
        runs += [r for _, r in sorted(tiered, key=lambda t: t[0])]
    return runs


def key(run):
    """The identity of a run: (backend, workload, runner, devices, policy)."""
    return (run["backend"], run["workload"], run["runner"], run["devices"],
            run.get("policy", "global"))


class Budget:
    """Seconds left for the whole command, and a guess of what a run costs: the longest
    finished run of the same backend and workload (process start, compile and epochs).

    Args:
        seconds: the budget (None: no limit).
        reserve: seconds kept for writing the report at the end.
    """

    def __init__(self, seconds=None, reserve=15.0, clock=time.monotonic):
        self.seconds, self.reserve, self.clock = seconds, reserve, clock
        self.started = clock()
        self._costs = {}

    def left(self):
        if self.seconds is None:
            return None
        return self.seconds - self.reserve - (self.clock() - self.started)

    def record(self, run, seconds):
        k = (run["backend"], run["workload"])
        self._costs[k] = max(self._costs.get(k, 0.0), float(seconds))

    def estimate(self, run):
        return self._costs.get((run["backend"], run["workload"]))

    def soft_deadline(self, batches_left):
        """For a worker running several runs (one process per workload): the time
        (``time.time()``) after which it starts no more tier-1/2 runs, so that the
        workloads still to come get their share of the time left (None: no budget)."""
        left = self.left()
        if left is None:
            return None
        return time.time() + max(left, 0.0) / max(batches_left, 1)

    def refuse(self, runs):
        """None if ``runs`` may start, else why not (in words)."""
        left = self.left()
        if left is None:
            return None
        if left <= 0:
            return "time budget spent"
        need = sum(self.estimate(r) or 0.0 for r in runs)
        if need > left:
            return f"time budget: about {need:.0f} s needed, {left:.0f} s left"
        return None

"""Which runs ``kmgpu bench`` makes, in which order, and whether the time budget still
allows the next group of them.

Runs come in units: one workload on one backend. The units go workload by workload (in
the order given), and for each workload every backend's unit before the next workload, so
a budget that ends early leaves complete rows of the first workloads on every backend, not
one backend's runs of every workload.

A workload's first unit per backend (``core``) holds what its row of the leading table
needs: plain fit on 1 device, kmgpu on 1 device, and kmgpu on all devices (global batch)
when there are several. Where runs share a process, plain fit runs
again after kmgpu (``replay``: plain, kmgpu, ..., plain), so the comparison is
order-balanced; with a process per run each run is its process's first and the replay is
an extra. The extras (kmgpu with the per_replica batch policy, the peer on all devices, the
torchvision reference, device counts
between 1 and all, the replay with a process per run) come as a second pass over the
workloads, then the all-reduce sweeps. No peer runs on one device: there it would measure
plain fit again. ``lean`` (``--lean``, ``--quick``) leaves out the peer's per_replica run.

A unit that would not fit the time left is skipped whole and said once; so is a unit that
would leave a backend with no complete row where the time left covers one (``Scheduler``).
"""

import time

RUNNERS = ("plain", "kmgpu", "peer", "reference", "allreduce")
POLICIES = ("global", "per_replica")
SWEEP_BACKENDS = ("jax", "torch")
REFERENCE = {"torch": ("resnet50", "resnet50_small")}


def units(backends, names, counts, replay=False, policies=POLICIES, runners=RUNNERS,
          lean=False, shared=True):
    """The units, in order, as dicts {backend, workload, core, runs}; each run a dict
    {backend, workload, runner, devices, policy} (see the module docstring).

    Args:
        replay: run plain fit again (the noise, and with ``shared`` the balance).
        shared: runs share a process (one per workload or per backend): the replay
            belongs to the core unit.
    """
    top = max(counts)

    def run(backend, workload, runner, n, policy="global"):
        wanted = runner in runners or runner == "replay"  # replay: its own switch
        if wanted and (policy in policies or runner == "allreduce"):
            return [{"backend": backend, "workload": workload, "runner": runner,
                     "devices": n, "policy": policy}]
        return []

    core, extra = [], []
    for name in names:
        for b in backends:
            runs = run(b, name, "plain", 1)
            if 1 in counts:
                runs += run(b, name, "kmgpu", 1)
            if top > 1:
                runs += run(b, name, "kmgpu", top)
            more = run(b, name, "replay", 1) if replay else []
            if shared:
                runs, more = runs + more, []
            if top > 1:
                more += run(b, name, "kmgpu", top, "per_replica") + run(b, name, "peer", top)
                if not lean:
                    more += run(b, name, "peer", top, "per_replica")
            if name in REFERENCE.get(b, ()):
                more += run(b, name, "reference", 1)
            for n in counts:
                if 1 < n < top:
                    for runner in ("kmgpu", "peer"):
                        for policy in POLICIES:
                            more += run(b, name, runner, n, policy)
            if runs:
                core.append({"backend": b, "workload": name, "core": True, "runs": runs})
            if more:
                extra.append({"backend": b, "workload": name, "core": False, "runs": more})
    sweeps = [{"backend": b, "workload": "allreduce", "core": False,
               "runs": run(b, "allreduce", "allreduce", top)}
              for b in backends if top > 1 and b in SWEEP_BACKENDS]
    return core + extra + [u for u in sweeps if u["runs"]]


def plan(backends, names, counts, replay=False, policies=POLICIES, runners=RUNNERS,
         lean=False, shared=True):
    """Every run of ``units(...)``, in order."""
    return [r for u in units(backends, names, counts, replay, policies, runners, lean, shared)
            for r in u["runs"]]


def key(run):
    """The identity of a run: (backend, workload, runner, devices, policy)."""
    return (run["backend"], run["workload"], run["runner"], run["devices"],
            run.get("policy", "global"))


class Budget:
    """Seconds left for the whole command, and a guess of what a run costs: the longest
    finished run of the same backend and workload (process start, compile and epochs);
    before any, ``prior`` seconds scaled by how the backend's finished runs compared
    with their priors.

    Args:
        seconds: the budget (None: no limit).
        reserve: seconds kept for writing the report at the end.
        prior: {workload: seconds a run is guessed to take, or {backend: seconds} where
            the backends differ} (missing: unknown; a backend missing from its dict: the
            dict's largest).
    """

    def __init__(self, seconds=None, reserve=15.0, clock=time.monotonic, prior=None):
        self.seconds, self.reserve, self.clock = seconds, reserve, clock
        self.prior = prior or {}
        self.started = clock()
        self._costs = {}
        self._scale = {}  # backend: [seconds measured, seconds its priors guessed]

    def left(self):
        if self.seconds is None:
            return None
        return self.seconds - self.reserve - (self.clock() - self.started)

    def _guess(self, run):
        guess = self.prior.get(run["workload"])
        if isinstance(guess, dict):
            return guess.get(run["backend"], max(guess.values()))
        return guess

    def record(self, run, seconds):
        k = (run["backend"], run["workload"])
        self._costs[k] = max(self._costs.get(k, 0.0), float(seconds))
        guess = self._guess(run)
        if guess:
            scale = self._scale.setdefault(run["backend"], [0.0, 0.0])
            scale[0] += float(seconds)
            scale[1] += guess

    def estimate(self, run):
        """Seconds ``run`` is guessed to take, or None where nothing is known."""
        known = self._costs.get((run["backend"], run["workload"]))
        if known is not None:
            return known
        guess = self._guess(run)
        if guess is None:
            return None
        measured, guessed = self._scale.get(run["backend"], (0.0, 0.0))
        return guess * (measured / guessed if guessed else 1.0)

    def need(self, runs):
        return sum(self.estimate(r) or 0.0 for r in runs)

    def refuse(self, runs, kept=0.0):
        """None if ``runs`` may start, else why not (in words); ``kept``: seconds of the
        time left held back for other units."""
        left = self.left()
        if left is None:
            return None
        if left <= 0:
            return "time budget spent"
        need = self.need(runs)
        if need > left - kept:
            return (f"about {need:.0f} s needed, {left:.0f} s left"
                    + (f" ({kept:.0f} s of it kept for other backends' first rows)"
                       if kept else ""))
        return None


class Scheduler:
    """Walks the units in order and says, for each, whether it runs: it fits the time
    left, less what the cheapest core unit of each other backend still without a row
    needs (where that alone fits), so each backend gets a complete row when the budget
    covers one each. Where it covers fewer, a backend's own cheapest row goes first and
    keeps time only for the others it leaves room for."""

    def __init__(self, units, budget):
        self.units, self.budget = list(units), budget
        self.attempted = set()  # backends whose core unit has run (a row, or its error)

    def __iter__(self):
        """Yields (unit, None) for a unit to run, (unit, reason) for one skipped whole;
        the caller runs the unit (and records its costs) before asking for the next."""
        for i, unit in enumerate(self.units):
            why = self.budget.refuse(unit["runs"], self._kept(unit, self.units[i + 1:]))
            if why is None and unit["core"]:
                self.attempted.add(unit["backend"])
            yield unit, why

    def _kept(self, unit, pending):
        left = self.budget.left()
        if left is None or not unit["core"]:
            return 0.0
        cheapest = {}
        for u in pending:
            if u["core"]:
                need = self.budget.need(u["runs"])
                cheapest[u["backend"]] = min(need, cheapest.get(u["backend"], need))
        mine = self.budget.need(unit["runs"])
        others = sorted(c for b, c in cheapest.items() if b != unit["backend"]
                        and b not in self.attempted and c <= left)
        if unit["backend"] not in self.attempted and mine <= cheapest.get(unit["backend"], mine):
            while others and mine + sum(others) > left:  # this row first, then who fits
                others.pop()
        return sum(others)


def skipped(unit, why):
    """The line said once for a unit skipped whole, and its runs' records."""
    line = f"{unit['workload']} on {unit['backend']}: skipped, {why}"
    return line, [dict(r, kind="run", status="skipped", reason=why) for r in unit["runs"]]

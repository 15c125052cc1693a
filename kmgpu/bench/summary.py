"""The leading table of ``kmgpu bench``: per model, each backend's samples/s under kmgpu
and under plain fit, kmgpu against plain fit as a ratio, how far plain fit was from
itself (a row over ``NOISE_LIMIT`` is not judged), the first epoch, evaluate and predict,
and which backend is fastest; with several devices also the speed-up over plain fit on
one and the efficiency; under it, for each row not judged, whether plain fit differed
from itself on the CPU or off it (``noise_notes``). Imports no backend."""

from kmgpu.bench import tables
from kmgpu.bench.tables import BACKEND_ORDER, fmt

CORE = ("plain", "kmgpu", "replay")


def _run(results, backend, workload, runner, n):
    return tables._find(results, backend, workload, runner, n, "global")


def row(results, backend, workload, top):
    """The figures of one backend on one workload (dict), or why there are none:
    {"missing": text}."""
    plain = _run(results, backend, workload, "plain", 1)
    replay = _run(results, backend, workload, "replay", 1)
    one = _run(results, backend, workload, "kmgpu", 1)
    k = _run(results, backend, workload, "kmgpu", top)
    needed = [plain, k] + ([one] if top > 1 else [])
    for r in needed:
        if r is None:
            return {"missing": "not run"}
    for r in needed:
        if r.get("status") != "ok":
            text = r.get("reason") if r.get("status") == "skipped" else r.get("error")
            return {"missing": f"{r.get('status', 'failed')}: {text or '?'}"[:120]}
    # plain fit before and, where it ran, after kmgpu: the mean is order-balanced
    base = [p["samples_per_s"] for p in (plain, replay) if p and p.get("status") == "ok"]
    plain_sps = sum(base) / len(base)
    out = {"kmgpu": k["samples_per_s"], "plain": plain_sps, "first": tables.first_epoch(k),
           "evaluate": k.get("evaluate_s"), "predict": k.get("predict_s"),
           "noise": tables.noise(plain, replay)}
    if one and one.get("status") == "ok":
        out["vs_plain"] = one["samples_per_s"] / plain_sps
    if top > 1:
        out["speedup"] = k["samples_per_s"] / plain_sps
        out["efficiency"] = out["speedup"] / top
    return out


def _noisy(r):
    """Whether a row's plain fit differs from itself by more than the limit."""
    return r["noise"] is not None and r["noise"] > tables.NOISE_LIMIT


def _top(results):
    return max([r["devices"] for r in results["runs"] if r["runner"] == "kmgpu"] or [1])


def _backends(results):
    return sorted({r["backend"] for r in results["runs"] if r["runner"] in CORE},
                  key=lambda b: BACKEND_ORDER.get(b, 9))


def workloads_in(results):
    """The workloads in the order the run took them (older results: by rank)."""
    names = [w for w in (results.get("workloads") or {})]
    seen = {r["workload"] for r in results["runs"] if r["runner"] in CORE}
    return [w for w in names if w in seen] + sorted(seen - set(names), key=tables.workload_rank)


def table(results):
    """The leading table, as markdown (title, table)."""
    top = _top(results)
    gpus = (results.get("machine") or {}).get("gpus") or []
    simulated = bool(results.get("simulate")) or not gpus
    if simulated:
        where = (f"{top} simulated devices" if results.get("simulate") else "a CPU")
        title = (f"## kmgpu on {where}, per model and backend: a code-path check on a CPU"
                 + (" (CI sizes)" if results.get("quick") else "") + ", not a speed")
    else:
        name = gpus[0].replace("NVIDIA ", "")
        title = f"## kmgpu on {top} {name}{'s' if top > 1 else ''}, per model and backend"
    unit = "device" if simulated else "GPU"
    many = top > 1
    head = ["model", "backend", f"kmgpu samples/s{f', {top} {unit}s' if many else ''}",
            f"plain fit samples/s{f', 1 {unit}' if many else ''}",
            f"kmgpu / plain fit{f', 1 {unit}' if many else ''}", "plain vs plain again"]
    if many:
        head += [f"speed-up, {top} {unit}s vs plain fit on 1", "efficiency"]
    head += ["1st epoch (s)", "evaluate (s)", "predict (s)", "vs fastest backend"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    backends = _backends(results)
    for workload in workloads_in(results):
        rows = {b: row(results, b, workload, top) for b in backends}
        done = {b: r["kmgpu"] for b, r in rows.items() if "kmgpu" in r}
        best = max(done, key=done.get) if done else None
        for b in backends:
            r = rows[b]
            if "missing" in r:
                lines.append(f"| {workload} | {b} | {r['missing']} |" + " |" * (len(head) - 3))
                continue
            if len(done) < 2:
                vs = "-"
            elif b == best:
                vs = "**fastest**"
            else:
                vs = f"{r['kmgpu'] / done[best]:.2f}x {best}"
            noisy = _noisy(r)
            cells = [fmt(r["kmgpu"], ",.0f"), fmt(r["plain"], ",.0f"),
                     _ratio(r.get("vs_plain")) + (", not judged" if noisy else ""),
                     "-" if r["noise"] is None else f"{r['noise'] * 100:.1f}%"
                     + (f" (over {tables.NOISE_LIMIT:.0%})" if noisy else "")]
            if many:
                cells += [_ratio(r.get("speedup")), fmt(r.get("efficiency"), ".2f")]
            cells += [r["first"], _secs(r["evaluate"]), _secs(r["predict"]), vs]
            lines.append(f"| {workload} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise_notes(results):
    """One line per row that is not judged, where both runs of plain fit kept what the host
    did (``hosttimes.py``): whether plain fit again differed on the CPU (its dispatching
    thread needed more or fewer CPU seconds for the same steps) or off it (the same CPU
    seconds, more or less waiting). [] where no row needs one."""
    import statistics

    notes, top = [], _top(results)
    for workload in workloads_in(results):
        for backend in _backends(results):
            r = row(results, backend, workload, top)  # the table's row, as it shows it
            if "missing" in r or not _noisy(r):
                continue
            plain = _run(results, backend, workload, "plain", 1)
            replay = _run(results, backend, workload, "replay", 1)
            if not (plain.get("host") and replay.get("host")):
                continue
            a, b = (statistics.median(r["epoch_seconds"]) for r in (plain, replay))
            ca, cb = (statistics.median(r["host"]["thread_cpu_s"]) for r in (plain, replay))
            wall, cpu = a / b - 1, (ca / cb - 1 if cb else 0.0)
            where = ("on the CPU: the dispatching thread's CPU seconds moved with the wall "
                     "time (the same code on a slower or faster CPU: its clock, its caches, "
                     "a busy sibling thread)"
                     if abs(cpu) >= abs(wall) / 2 and cpu * wall > 0 else
                     "off the CPU: about the same CPU seconds, more or less time waiting "
                     "(for the device's work, for a CPU taken by another thread or guest)")
            steal = [sum(x for x in r["host"]["steal_s"] if x is not None)
                     for r in (plain, replay)]
            preempted = [sum(r["host"]["preemptions"]) for r in (plain, replay)]
            notes.append(
                f"- {workload} on {backend}, not judged: plain fit {a:.3f} s an epoch, plain "
                f"fit again {b:.3f} s ({wall:+.1%}); the dispatching thread's CPU {ca:.3f} s "
                f"against {cb:.3f} s an epoch ({cpu:+.1%}); preempted {preempted[0]} against "
                f"{preempted[1]} times, machine steal {steal[0]:.2f} s against "
                f"{steal[1]:.2f} s: the difference was {where}.")
    return notes


LEGEND = (
    "samples/s: median of the timed epochs after the warm-up, global batch (the "
    "workload's); plain fit samples/s: the mean of plain `model.fit` before and after "
    "kmgpu; kmgpu / plain fit: kmgpu's samples/s on one device over plain fit's "
    "(order-balanced: plain fit before and after kmgpu in one process, averaged, or each "
    "run in a process of its own); plain vs plain again: the same code twice, |a / b - 1|, "
    "the resolution of the ratio beside it: over 5% the ratio is 'not judged'; speed-up: "
    "kmgpu on N devices over plain fit on one; efficiency: speed-up / N; 1st epoch: the "
    "warm-up's wall time, compilation included (*: the process had run plain fit before "
    "it: warm caches, and on JAX the compiled program loaded from the compilation cache "
    "where it is the same); evaluate, predict: seconds of one call on the same first "
    "batches of the data for every runner, the median of 3 after an untimed call "
    "(--quick: the first call, compile included); vs fastest backend: samples/s under "
    "kmgpu against the fastest backend's on the same model. A skipped row was skipped "
    "whole, for the reason given.")


def _ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def _secs(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"

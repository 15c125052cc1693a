"""Benchmark results (the JSON ``kmgpu bench`` writes) -> markdown tables; ``write`` also
draws the plot (``figure.py``).

Imports neither Keras nor a backend: a notebook or a reader of the results can use it
anywhere. Older results files (no batch policy, no FLOPs) read as well.
"""

import json
import math
import os

from kmgpu.bench import summary, tables
from kmgpu.bench.tables import BACKEND_ORDER, fmt, mem, pct, workload_rank

RUNNER_ORDER = {"plain": 0, "replay": 1, "reference": 2, "kmgpu": 3, "peer": 4}
# The targets kmgpu is held to, as ratios of samples/s (higher is better).
PLAIN_TARGET = 0.99  # on one device: at least 0.99x plain model.fit
PEER_TARGET = 1.0  # at least the peer's, at the same N and policy
NOISE_LIMIT = tables.NOISE_LIMIT
noise = tables.noise


def load(path):
    with open(path) as f:
        return json.load(f)


def simulated(results):
    return bool(results.get("simulate")) or not (results.get("machine") or {}).get("gpus")


def sorted_runs(results):
    return sorted(results["runs"], key=lambda r: (
        workload_rank(r["workload"]), BACKEND_ORDER.get(r["backend"], 9), r["devices"],
        r.get("policy", "global") != "global", RUNNER_ORDER.get(r["runner"], 9)))


def runner_label(r):
    if r["runner"] == "peer":
        return r.get("peer_name") or "peer"
    return {"plain": "plain fit", "replay": "plain fit, again", "kmgpu": "kmgpu",
            "reference": "torchvision + PyTorch loop"}.get(r["runner"], r["runner"])


def _status(r):
    if r.get("status") == "skipped":
        return f"skipped: {r.get('reason', '?')}"
    return f"failed: {r.get('error', '?')}"


def runs_table(results):
    """Every run: samples/s, first epoch, efficiency, parity, MFU, memory, loss/RMSE."""
    head = ("| workload | backend | runner | N | policy | global batch | samples/s | 1st epoch (s) "
            "| efficiency | parity vs 1 device | MFU | peak memory | GPU util | loss | sine RMSE |")
    lines = [head, "|" + "---|" * 15]
    for r in sorted_runs(results):
        if r["runner"] == "allreduce":
            continue
        start = (f"| {r['workload']} | {r['backend']} | {runner_label(r)} | {r['devices']} | "
                 f"{r.get('policy', 'global')} |")
        if r.get("status") != "ok":
            lines.append(start + f" {_status(r)} |" + "  |" * 9)
            continue
        util = r.get("gpu_util")
        lines.append(
            start + f" {r.get('global_batch', '-')} | {fmt(r['samples_per_s'], ',.0f')} | "
            f"{tables.first_epoch(r)} | {fmt(r.get('efficiency'), '.2f')} | "
            f"{fmt(r.get('parity'), '.1e')} | {pct(r.get('mfu'))} | {mem(r)} | "
            f"{fmt(util, '.0f')}{'%' if util is not None else ''} | "
            f"{fmt(r.get('loss'), '.4g')} | {fmt(r.get('rmse'), '.3f')} |")
    return "\n".join(lines)


def comparison_rows(results):
    """Per backend, workload, N and policy: kmgpu, plain fit and peer samples/s, ratios."""
    runs = tables.index(results)
    rows = []
    keys = sorted({(r["backend"], r["workload"], r["devices"], r.get("policy", "global"))
                   for r in results["runs"] if r["runner"] == "kmgpu"},
                  key=lambda k: (workload_rank(k[1]), BACKEND_ORDER.get(k[0], 9), k[2],
                                 k[3] != "global"))
    for backend, workload, n, policy in keys:
        k = runs.get((backend, workload, "kmgpu", n, policy))
        plain = runs.get((backend, workload, "plain", 1, "global"))
        replay = runs.get((backend, workload, "replay", 1, "global"))
        peer = runs.get((backend, workload, "peer", n, policy))
        row = {"backend": backend, "workload": workload, "devices": n, "policy": policy,
               "kmgpu": k and k["samples_per_s"], "plain": plain and plain["samples_per_s"],
               "peer": peer and peer["samples_per_s"], "peer_error": None,
               "vs_plain": None, "vs_peer": None, "noise": noise(plain, replay)}
        row["noisy"] = row["noise"] is not None and row["noise"] > NOISE_LIMIT
        if peer is None:
            failed = [r for r in results["runs"] if (
                r["backend"], r["workload"], r["runner"], r["devices"],
                r.get("policy", "global")) == (backend, workload, "peer", n, policy)]
            row["peer_error"] = _status(failed[0]) if failed else None
        if k and plain:
            # plain before and (replay) after kmgpu: the mean is order-balanced (A B A)
            base = [p["samples_per_s"] for p in (plain, replay) if p]
            row["vs_plain"] = k["samples_per_s"] / (sum(base) / len(base))
            # a process per run: each run is its process's first, balanced as it stands
            row["balanced"] = bool(replay) or results.get("isolate") == "run"
        if k and peer:
            row["vs_peer"] = k["samples_per_s"] / peer["samples_per_s"]
        rows.append(row)
    return rows


COMPARISON_LEGEND = (
    "kmgpu / plain fit: kmgpu's samples/s over plain `model.fit`'s (N > 1: kmgpu on N "
    "devices over plain fit on one, the speed-up); plain is the mean of plain fit before "
    "kmgpu and, where it ran, plain fit again after it (order-balanced: A B A; without "
    "that second run 'unbalanced'). On one device the target is >= 0.99x. plain vs plain "
    "again (noise): the same code twice, |a / b - 1|: a row whose noise is over 5% is "
    "marked 'not judged' (its ratio is inside its own noise), not met or missed. "
    "kmgpu / peer: kmgpu's samples/s over the framework's own data-parallel way at the "
    "same N and policy (target >= 1.00x; only where a peer ran). On simulated CPU devices "
    "the runs share the cores: the marks judge the code path, not a speed.")


def judged(ratio, target, row=None):
    """A ratio and its mark: met, missed, or not judged (noise over the limit)."""
    text = f"{ratio:.2f}x"
    if row is not None and row.get("noisy"):
        return text + f" not judged (noise over {NOISE_LIMIT:.0%})"
    return text + (" met" if ratio >= target else " **missed**")


def comparison_table(results):
    peers = any(r["runner"] == "peer" for r in results["runs"])
    head = ["workload", "backend", "N", "policy", "kmgpu samples/s", "plain fit (1 device)"]
    head += ["peer"] if peers else []
    head += [f"kmgpu / plain fit (target >= {PLAIN_TARGET:.2f}x on 1 device)",
             "plain vs plain again (noise)"]
    head += [f"kmgpu / peer (target >= {PEER_TARGET:.2f}x)"] if peers else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in comparison_rows(results):
        ratio = row["vs_plain"]
        if ratio is None:
            ratio_text = "-"
        elif row["devices"] == 1:
            ratio_text = judged(ratio, PLAIN_TARGET, row) + (
                "" if row.get("balanced") else " (unbalanced)")
        else:
            ratio_text = f"{ratio:.2f}x"
        noise_text = "-" if row["noise"] is None else (
            f"{row['noise'] * 100:.1f}%" + (f" (over {NOISE_LIMIT:.0%})" if row["noisy"] else ""))
        cells = [row["workload"], row["backend"], str(row["devices"]), row["policy"],
                 fmt(row["kmgpu"], ",.0f"), fmt(row["plain"], ",.0f")]
        if peers:
            cells.append(fmt(row["peer"], ",.0f"))
        cells += [ratio_text, noise_text]
        if peers:
            if row["vs_peer"] is not None:
                cells.append(judged(row["vs_peer"], PEER_TARGET))
            else:
                cells.append(f"peer {row['peer_error']}" if row["peer_error"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(results, toys=False):
    """The leading table: N GPUs against 1 for each workload, backend and batch policy
    (``toys``: the same table for the toy workloads)."""
    return tables.headline(results, toys, simulated(results))


def _jobs(jobs):
    if not isinstance(jobs, dict):  # older results: none
        return ""
    many = [f"{b} {n}" for b, n in jobs.items() if n > 1]
    return ("; worker processes at once: " + ", ".join(many)
            + " (their timings disturb each other)") if many else ""


def _machine(results):
    m = results.get("machine", {})
    gpus = m.get("gpus") or []
    text = (f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU") + \
        f"; {m.get('cpu_count', '?')} CPU cores; Python {m.get('python', '?')}"
    if results.get("simulate"):
        text += f"; {results['simulate']} simulated devices"
    return text


def _no_machine_path(arg):
    """A command's argument for a report: an absolute path as .../its last part (where
    the results were written on that machine is of no use to a reader)."""
    return ".../" + os.path.basename(arg.rstrip("/")) if os.path.isabs(arg) else arg


def markdown(results):
    """The whole report as markdown: the table per model and backend first (with several
    devices the speedup table next), then the plot."""
    isolate = {"run": "a fresh process for every run",
               "workload": "one process per backend and workload (later runs find warm "
                           "caches; memory figures accumulate)",
               "backend": "one process per backend (later runs find warm caches; memory "
                          "figures accumulate)"}.get(results.get("isolate"), "?")
    commands = results.get("commands") or [results.get("command", [])]
    lines = [f"# kmgpu bench: {results.get('name', '')}", "",
             f"- machine: {_machine(results)}",
             f"- created: {results.get('created', '?')}; command: "
             + "; ".join(f"`{' '.join(_no_machine_path(a) for a in c)}`" for c in commands),
             f"- mode: {'quick (CPU-sized)' if results.get('quick') else 'full'}; {isolate}"
             + _jobs(results.get("jobs"))
             + (f"; time budget {results['budget']:.0f} s" if results.get("budget") else "")]
    for name, b in sorted(results.get("backends", {}).items(),
                          key=lambda kv: BACKEND_ORDER.get(kv[0], 9)):
        if b.get("status") == "ok":
            lines.append(f"- {name}: {name} {b.get('backend_version')}, keras "
                         f"{b.get('keras')}, devices {', '.join(b.get('devices', []))}"
                         + (f" ({', '.join(b['device_kinds'])})" if b.get("device_kinds")
                            else "") + f"; peer: {b.get('peer_name', '-')}")
        else:
            lines.append(f"- {name}: skipped ({b.get('reason', b.get('status'))})")
    lines.append("- workloads: " + "; ".join(
        f"{w}: {d.get('description', '')}, batch {d['batch']}, {d['epochs']} epochs"
        + (f" x {d['steps']} steps" if d.get("steps") else "")
        for w, d in sorted(results.get("workloads", {}).items(),
                           key=lambda kv: workload_rank(kv[0]))))
    if simulated(results):
        lines += ["", "**On a CPU the simulated devices share the same cores: these figures "
                  "test the code path; they are not speedups.**"]
    if results.get("quick"):
        lines += ["", "Quick mode: JAX runs share a persistent compilation cache, so their "
                  "first epochs are not compile times; on a CPU, XLA compiles without "
                  "LLVM optimisation (`--xla_backend_optimization_level=0`)."]
    lines += ["", summary.table(results), ""]
    notes = summary.noise_notes(results)
    if notes:
        lines += ["Why the rows not judged differ from themselves, from what the host did in "
                  "each timed epoch:", ""] + notes + [""]
    lines += [summary.LEGEND, ""]
    if plot_missing() is None:
        lines += [f"![samples/s per model and backend]({results.get('name', '')}.png)", ""]
    if tables.top_devices(results) > 1:
        lines += [headline(results), ""]
    lines += [tables.legend(results), ""]
    toys = headline(results, toys=True)
    if toys:
        lines += ["### Toy workloads (launch-bound)", "", toys, ""]
    lines += tables.backend_section(results)
    lines += tables.projection_section(results)
    lines += ["## kmgpu against plain fit and the peer", "", comparison_table(results), "",
              COMPARISON_LEGEND, "",
              "## Every run", "", runs_table(results), ""]
    return "\n".join(lines)


def plot_missing():
    """Why ``write`` draws no PNG here (None: it does)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib"
    return None


def plot(results, path=None, show=False):
    from kmgpu.bench import figure

    return figure.plot(results, path, show=show)


def merge(many):
    """One results dict from several (e.g. one ``gpu_run.sh`` per backend on the same
    machine): runs, backends and workloads together; a later file's run replaces an
    earlier one with the same identity."""
    if not many:
        raise ValueError("nothing to merge")
    first = many[0]
    merged = {k: v for k, v in first.items() if k not in ("runs",)}
    merged["name"] = "+".join(r.get("name", "?") for r in many)
    merged["created"] = max(r.get("created", "") for r in many)
    merged["commands"] = [r.get("command", []) for r in many]
    merged["backends"], merged["workloads"], merged["projection"] = {}, {}, {}
    runs = {}
    for r in many:
        merged["backends"].update(r.get("backends", {}))
        merged["workloads"].update(r.get("workloads", {}))
        merged["projection"].update(r.get("projection") or {})
        merged["quick"] = merged.get("quick") or r.get("quick")
        for run in r["runs"]:
            runs[(run["backend"], run["workload"], run["runner"], run["devices"],
                  run.get("policy", "global"))] = run
    merged["runs"] = list(runs.values())
    gpus = {tuple((r.get("machine") or {}).get("gpus") or []) for r in many}
    if len(gpus) > 1:
        merged["machine"] = dict(merged["machine"], note="merged from different machines")
    return merged


def write(results, folder):
    """Write <name>.json, <name>.md and (with matplotlib, see ``plot_missing``) <name>.png
    into ``folder``; return their paths."""
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, results["name"])
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))
    paths = [base + ".json", base + ".md"]
    if plot_missing() is None:
        plot(results, base + ".png")
        paths.append(base + ".png")
    return paths


def _json_default(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)

"""Benchmark results (the JSON ``kmgpu bench`` writes) -> markdown tables and a PNG plot.

Imports neither Keras nor a backend: a notebook or a reader of the results can use it
anywhere matplotlib is installed.
"""

import json
import math
import os

RUNNER_ORDER = {"plain": 0, "replay": 1, "kmgpu": 2, "peer": 3}
BACKEND_ORDER = {"tensorflow": 0, "jax": 1, "torch": 2}
# Targets of issue 6, on one device.
OVERHEAD_TARGET = 0.01  # kmgpu's time per epoch at most 1% above plain model.fit
PEER_TARGET = 1.0  # kmgpu samples/s at least the peer's


def load(path):
    with open(path) as f:
        return json.load(f)


def ok_runs(results):
    return [r for r in results["runs"] if r.get("status") == "ok"]


def results_workload_order(r):
    return ({"cnn32": 0, "lstm": 1, "sine": 2}.get(r["workload"], 9), r["workload"])


def sorted_runs(results):
    return sorted(results["runs"], key=lambda r: (
        results_workload_order(r), BACKEND_ORDER.get(r["backend"], 9),
        r["devices"], RUNNER_ORDER.get(r["runner"], 9)))


def _fmt(x, spec):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _mem(r):
    if not r.get("peak_memory"):
        return "-"
    text = f"{r['peak_memory'] / 2**30:.2f} GiB" if r["peak_memory"] >= 2**30 else \
        f"{r['peak_memory'] / 2**20:.0f} MiB"
    return text + (" (RSS)" if r.get("memory_kind") == "rss" else "")


def runner_label(r, results=None):
    if r["runner"] != "peer":
        return {"plain": "plain fit", "replay": "plain fit, again", "kmgpu": "kmgpu"}.get(
            r["runner"], r["runner"])
    return r.get("peer_name") or "peer"


def runs_table(results):
    """Every run: samples/s, first epoch, efficiency, parity, memory, loss/RMSE."""
    head = ("| workload | backend | runner | N | samples/s | 1st epoch (s) | efficiency "
            "| parity vs 1 device | peak memory | GPU util | loss | sine RMSE |")
    lines = [head, "|" + "---|" * 12]
    for r in sorted_runs(results):
        if r.get("status") != "ok":
            lines.append(f"| {r['workload']} | {r['backend']} | {runner_label(r)} | "
                         f"{r['devices']} | failed: {r.get('error', '?')} |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['workload']} | {r['backend']} | {runner_label(r)} | {r['devices']} | "
            f"{_fmt(r['samples_per_s'], ',.0f')} | {_fmt(r['first_epoch_s'], '.2f')} | "
            f"{_fmt(r.get('efficiency'), '.2f')} | {_fmt(r.get('parity'), '.1e')} | "
            f"{_mem(r)} | {_fmt(r.get('gpu_util'), '.0f')}{'%' if r.get('gpu_util') is not None else ''} | "
            f"{_fmt(r.get('loss'), '.4g')} | {_fmt(r.get('rmse'), '.3f')} |")
    return "\n".join(lines)


def comparison_rows(results):
    """Per backend, workload and N: kmgpu, plain fit and peer samples/s and the ratios."""
    runs = {(r["backend"], r["workload"], r["runner"], r["devices"]): r for r in ok_runs(results)}
    rows = []
    keys = sorted({(r["backend"], r["workload"], r["devices"]) for r in results["runs"]
                   if r["runner"] == "kmgpu"},
                  key=lambda k: (results_workload_order({"workload": k[1]}),
                                 BACKEND_ORDER.get(k[0], 9), k[2]))
    for backend, workload, n in keys:
        k = runs.get((backend, workload, "kmgpu", n))
        plain = runs.get((backend, workload, "plain", 1))
        replay = runs.get((backend, workload, "replay", 1))
        peer = runs.get((backend, workload, "peer", n))
        row = {"backend": backend, "workload": workload, "devices": n,
               "kmgpu": k and k["samples_per_s"], "plain": plain and plain["samples_per_s"],
               "peer": peer and peer["samples_per_s"], "peer_error": None,
               "overhead": None, "vs_peer": None, "noise": None}
        if plain and replay and n == 1:
            row["noise"] = plain["samples_per_s"] / replay["samples_per_s"] - 1
        if peer is None:
            failed = [r for r in results["runs"] if (r["backend"], r["workload"], r["runner"],
                                                     r["devices"]) == (backend, workload, "peer", n)]
            row["peer_error"] = failed[0].get("error") if failed else "not run"
        if k and plain and n == 1:
            row["overhead"] = plain["samples_per_s"] / k["samples_per_s"] - 1
        if k and peer:
            row["vs_peer"] = k["samples_per_s"] / peer["samples_per_s"]
        rows.append(row)
    return rows


def comparison_table(results):
    head = ("| workload | backend | N | kmgpu samples/s | plain fit (1 device) | peer | "
            "kmgpu overhead vs plain fit (target <= 1%) | plain vs plain again (noise) "
            "| kmgpu / peer (target >= 1.0) |")
    lines = [head, "|" + "---|" * 9]
    for row in comparison_rows(results):
        over = row["overhead"]
        over_text = "-" if over is None else (
            f"{over * 100:+.1f}% " + ("met" if over <= OVERHEAD_TARGET else "**missed**"))
        if row["vs_peer"] is not None:
            ratio = f"{row['vs_peer']:.3f} " + ("met" if row["vs_peer"] >= PEER_TARGET
                                                 else "**missed**")
        else:
            ratio = f"peer failed: {row['peer_error']}" if row["peer_error"] else "-"
        noise = "-" if row["noise"] is None else f"{row['noise'] * 100:+.1f}%"
        lines.append(
            f"| {row['workload']} | {row['backend']} | {row['devices']} | "
            f"{_fmt(row['kmgpu'], ',.0f')} | {_fmt(row['plain'], ',.0f')} | "
            f"{_fmt(row['peer'], ',.0f')} | {over_text} | {noise} | {ratio} |")
    return "\n".join(lines)


def markdown(results):
    """The whole report as markdown."""
    m = results.get("machine", {})
    gpus = m.get("gpus") or []
    machine = (f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU") + \
        f"; {m.get('cpu_count', '?')} CPU cores; Python {m.get('python', '?')}"
    if results.get("simulate"):
        machine += f"; {results['simulate']} simulated devices"
    isolate = {"run": "a fresh process for every run",
               "workload": "one process per backend and workload (later runs find warm "
                           "caches; memory figures accumulate)",
               "backend": "one process per backend (later runs find warm caches; memory "
                          "figures accumulate)"}.get(results.get("isolate"), "?")
    lines = [f"# kmgpu bench: {results.get('name', '')}", "",
             f"- machine: {machine}",
             f"- created: {results.get('created', '?')}; command: "
             f"`{' '.join(results.get('command', []))}`",
             f"- mode: {'quick (CPU-sized)' if results.get('quick') else 'full'}; {isolate}"]
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
        for w, d in results.get("workloads", {}).items()))
    lines += ["", "samples/s: median over the epochs after the first; 1st epoch: its wall "
              "time (includes tracing/compilation); efficiency: samples/s(N) / (N x "
              "samples/s(1)) of the same runner; parity: largest relative weight "
              "difference after training against plain model.fit on one device from the "
              "same initial weights (`plain fit, again` shows the floor where GPU kernels "
              "are not deterministic); peak memory: the GPU's memory in use as nvidia-smi "
              "shows it (NVML, sampled every 0.2 s; every process of the run, CUDA contexts "
              "included; JAX without preallocation), or the process's peak RSS (marked) "
              "where there is no GPU; overhead: plain fit's samples/s over kmgpu's, minus 1.",
              "", "## kmgpu against plain fit and the peer", "",
              comparison_table(results), "", "## Every run", "", runs_table(results), ""]
    return "\n".join(lines)


def plot(results, path=None, show=False):
    """Samples/s per workload (bars: plain fit, kmgpu, peer at each device count) and,
    where more than one device count ran, scaling efficiency. Returns the figure."""
    import matplotlib

    if path and not show:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = ok_runs(results)
    workloads = [w for w in ("cnn32", "lstm", "sine") if any(r["workload"] == w for r in runs)]
    workloads += sorted({r["workload"] for r in runs} - set(workloads))
    multi = any(r["devices"] > 1 for r in runs)
    rows = 2 if multi else 1
    fig, axes = plt.subplots(rows, max(len(workloads), 1), squeeze=False,
                             figsize=(4.6 * max(len(workloads), 1), 3.8 * rows))
    colours = {"plain": "#999999", "kmgpu": "#1f77b4", "peer": "#ff7f0e"}
    for col, workload in enumerate(workloads):
        ax = axes[0][col]
        mine = [r for r in runs if r["workload"] == workload]
        groups = sorted({(r["backend"], r["devices"]) for r in mine},
                        key=lambda g: (BACKEND_ORDER.get(g[0], 9), g[1]))
        width = 0.27
        for g, (backend, n) in enumerate(groups):
            for runner, offset in (("plain", -1), ("kmgpu", 0), ("peer", 1)):
                hit = [r for r in mine if (r["backend"], r["devices"], r["runner"]) ==
                       (backend, n, runner)]
                if hit:
                    ax.bar(g + offset * width, hit[0]["samples_per_s"], width,
                           color=colours[runner],
                           label=runner if (g == 0 or not ax.get_legend_handles_labels()[1]
                                            or runner not in ax.get_legend_handles_labels()[1])
                           else None)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{b}\nN={n}" for b, n in groups], fontsize=8)
        ax.set_title(workload)
        ax.set_ylabel("samples/s")
        handles, labels = ax.get_legend_handles_labels()
        names = {"plain": "plain fit (1 device)", "kmgpu": "kmgpu", "peer": "peer"}
        ax.legend(handles, [names.get(label, label) for label in labels], fontsize=8)
        if multi:
            ax2 = axes[1][col]
            for backend in sorted({r["backend"] for r in mine}, key=BACKEND_ORDER.get):
                for runner, style in (("kmgpu", "-o"), ("peer", "--s")):
                    pts = sorted((r["devices"], r.get("efficiency")) for r in mine
                                 if r["backend"] == backend and r["runner"] == runner
                                 and r.get("efficiency") is not None)
                    if pts:
                        ax2.plot([p[0] for p in pts], [p[1] for p in pts], style,
                                 label=f"{backend} {runner}")
            ax2.axhline(1.0, color="#bbbbbb", lw=0.8)
            ax2.set_xlabel("devices N")
            ax2.set_ylabel("scaling efficiency")
            ax2.legend(fontsize=7)
    title = results.get("name", "")
    gpus = results.get("machine", {}).get("gpus") or []
    fig.suptitle(f"kmgpu bench {title}" + (f" - {len(gpus)} x {gpus[0]}" if gpus else ""))
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    if not show:
        plt.close(fig)
    return fig


def write(results, folder):
    """Write <name>.json, <name>.md and <name>.png into ``folder``; return their paths."""
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, results["name"])
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))
    paths = [base + ".json", base + ".md"]
    try:
        plot(results, base + ".png")
        paths.append(base + ".png")
    except ImportError:
        pass  # no matplotlib: the table and JSON are still there
    return paths

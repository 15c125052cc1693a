"""The report's headline, backend and projection tables, and the formatting they share
(``report.py`` puts the whole report together)."""

import math

from kmgpu.bench import flops, projection
from kmgpu.bench.workloads import NAMES, TOYS

BACKEND_ORDER = {"tensorflow": 0, "jax": 1, "torch": 2}
POLICIES = ("global", "per_replica")
NOISE_LIMIT = 0.05  # a row whose plain fit differs from itself by more is not judged


def noise(plain, replay):
    """How far plain fit and plain fit again are apart: |a / b - 1| of their samples/s
    (None without both finished)."""
    if not (plain and replay and plain.get("status", "ok") == "ok"
            and replay.get("status", "ok") == "ok"):
        return None
    return abs(plain["samples_per_s"] / replay["samples_per_s"] - 1)


def fmt(x, spec):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def pct(x):
    return "-" if x is None else (f"{x * 100:.1f}%" if x >= 0.001 else f"{x * 100:.2f}%")


def mem(r):
    if not r.get("peak_memory"):
        return "-"
    text = f"{r['peak_memory'] / 2**30:.2f} GiB" if r["peak_memory"] >= 2**30 else \
        f"{r['peak_memory'] / 2**20:.0f} MiB"
    return text + (" (RSS)" if r.get("memory_kind") == "rss" else "")


def first_epoch(r):
    """The first epoch's seconds; * where the run's process had run others before."""
    if not r or r.get("first_epoch_s") is None:
        return "-"
    return fmt(r["first_epoch_s"], ".1f") + ("*" if r.get("runs_before") else "")


def ok_runs(results):
    return [r for r in results["runs"] if r.get("status") == "ok"]


def workload_rank(name):
    return (NAMES.index(name) if name in NAMES else len(NAMES), name)


def index(results):
    return {(r["backend"], r["workload"], r["runner"], r["devices"], r.get("policy", "global")): r
            for r in ok_runs(results)}


def _find(results, backend, workload, runner, n, policy):
    for r in results["runs"]:
        if (r["backend"], r["workload"], r["runner"], r["devices"],
                r.get("policy", "global")) == (backend, workload, runner, n, policy):
            return r
    return None


def _cell(r, value):
    if r is None:
        return "not run"
    if r.get("status") != "ok":
        text = r.get("reason") if r.get("status") == "skipped" else r.get("error")
        return f"{r.get('status', 'failed')}: {text or '?'}"[:120]
    return value(r)


def gpu_label(results, top):
    gpus = (results.get("machine") or {}).get("gpus") or []
    if gpus and not results.get("simulate"):
        short = gpus[0].replace("NVIDIA ", "")
        return f"{top} {short}s vs 1", "GPU"
    return f"{top} simulated devices vs 1", "device"


def top_devices(results):
    counts = [r["devices"] for r in results["runs"] if r["runner"] in ("kmgpu", "peer")]
    return max(counts) if counts else 1


def headline(results, toys, simulated):
    """The speedup table (see ``report.headline``)."""
    top = top_devices(results)
    names = sorted({r["workload"] for r in results["runs"] if r["runner"] != "allreduce"
                    and (r["workload"] in TOYS) == toys}, key=workload_rank)
    label, unit = gpu_label(results, top)
    title = (f"## {label}: speedup per workload, backend and batch policy"
             + (" (simulated devices share the CPU cores: not speedups)" if simulated else ""))
    if not names:
        return "" if toys else title + "\n\nNo runs of these workloads in these results."
    runs = index(results)
    peers = any(r["runner"] == "peer" for r in results["runs"])
    head = ["workload", "backend", "policy", f"global batch 1 -> {top}",
            f"plain fit, 1 {unit} (samples/s)", f"kmgpu, {top} {unit}s (samples/s)",
            "speedup", "efficiency"] + (["kmgpu / peer"] if peers else []) + [
            f"MFU 1 -> {top}", f"1st epoch (s) 1 -> {top}", f"peak memory, {top} {unit}s"]
    lines = ([] if toys else [title, ""]) + ["| " + " | ".join(head) + " |",
                                             "|" + "---|" * len(head)]
    for workload in names:
        for backend in sorted({r["backend"] for r in results["runs"]
                               if r["workload"] == workload}, key=BACKEND_ORDER.get):
            plain = runs.get((backend, workload, "plain", 1, "global"))
            plain_any = _find(results, backend, workload, "plain", 1, "global")
            for policy in POLICIES:
                k_any = _find(results, backend, workload, "kmgpu", top, policy)
                if k_any is None or top == 1:
                    continue
                k = runs.get((backend, workload, "kmgpu", top, policy))
                peer = runs.get((backend, workload, "peer", top, policy))
                speed = k.get("vs_plain") if k else None
                batch1 = plain["global_batch"] if plain and plain.get("global_batch") else "-"
                batch_n = k.get("global_batch", "-") if k else "-"
                cells = [workload, backend, policy, f"{batch1} -> {batch_n}",
                         _cell(plain_any, lambda r: fmt(r['samples_per_s'], ',.0f')),
                         _cell(k_any, lambda r: fmt(r['samples_per_s'], ',.0f')),
                         f"{fmt(speed, '.2f')}x" if speed else "-",
                         fmt(speed / top if speed else None, '.2f')]
                if peers:
                    cells.append(fmt(k["samples_per_s"] / peer["samples_per_s"], ".2f")
                                 if k and peer else "-")
                cells += [f"{pct(plain and plain.get('mfu'))} -> {pct(k and k.get('mfu'))}",
                          f"{first_epoch(plain)} -> {first_epoch(k)}", mem(k) if k else "-"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def legend(results):
    """What the headline's columns are, and which FLOP counts and peaks MFU used."""
    text = ("samples/s: median of the timed epochs after the warm-up; speedup: kmgpu's samples/s "
            "on N devices over plain `model.fit` on one, measured in the same run; efficiency: "
            "speedup / N (it can exceed 1 where one device's run is slowed by something N "
            "devices split, e.g. a host-bound step, memory traffic or a batch that does not "
            "fill one GPU; or where samples/s on N devices rides on a larger global batch, "
            "per_replica); parity: the largest relative difference between the run's final "
            "weights and plain fit's (max |a - b| / max |b|; 0 = the same weights; GPU "
            "kernels that are not deterministic leave 1e-3..1 after a few epochs of Adam, "
            "plain against plain again included); policy global: the same global batch on 1 and N devices (strong "
            "scaling); per_replica: each device takes the one-device batch (global N x batch, "
            "learning rate x N; weak scaling); kmgpu / peer: against the framework's own way "
            "at the same N and policy; 1st epoch: its wall time, compilation included; MFU: "
            "model FLOPs per sample x samples/s / (N x the GPU's peak dense FLOP/s for the "
            "precision in use).")
    sources = sorted({(r["backend"], r.get("flops_source")) for r in ok_runs(results)
                      if r.get("flops_source") and r["runner"] == "plain"})
    peaks = sorted({(r["backend"], r.get("precision"), r.get("peak_flops"))
                    for r in ok_runs(results) if r.get("precision")
                    and r["runner"] in ("plain", "kmgpu")}, key=str)
    lines = [text]
    if any(r.get("runs_before") for r in ok_runs(results)):
        lines.append("*: the run's process had run other runs before it (one process per "
                     "workload or backend): warm caches (XLA's autotuning results, cuDNN, the "
                     "torch worker pool) make that first epoch shorter than a fresh "
                     "process's.")
    if sources:
        lines.append("FLOPs per sample: " + "; ".join(f"{b}: {s}" for b, s in sources) + ".")
    if peaks:
        lines.append("Precision and peak: " + "; ".join(sorted({
            f"{b} {flops.PRECISION_NAMES.get(p, p)}"
            + (f" ({peak / 1e12:.0f} TFLOP/s)" if peak else " (no peak known: no MFU)")
            for b, p, peak in peaks})) + ".")
    return "\n\n".join(lines)


def backend_section(results):
    """Plain fit on one device, per workload and backend, beside the pure-framework
    reference where one ran."""
    backends = sorted({r["backend"] for r in results["runs"] if r["runner"] == "plain"},
                      key=BACKEND_ORDER.get)
    if not backends:
        return []
    names = sorted({r["workload"] for r in results["runs"] if r["runner"] == "plain"},
                   key=workload_rank)
    has_ref = any(r["runner"] == "reference" for r in results["runs"])
    _, unit = gpu_label(results, 1)
    head = ("| workload | " + " | ".join(f"Keras/{b}" for b in backends)
            + (" | torchvision in plain PyTorch |" if has_ref else " |"))
    lines = [f"## Backends side by side: plain fit on one {unit} (samples/s, MFU)", "",
             "The cost of each Keras backend before any distribution"
             + (", and the same network without Keras." if has_ref else "."), "",
             head, "|" + "---|" * (1 + len(backends) + has_ref)]

    def show(r):
        return fmt(r["samples_per_s"], ",.0f") + (f" ({pct(r['mfu'])})" if r.get("mfu") else "")

    for w in names:
        cells = [_cell(_find(results, b, w, "plain", 1, "global"), show) for b in backends]
        if has_ref:
            ref = _find(results, "torch", w, "reference", 1, "global")
            cells.append(_cell(ref, show) if ref else "-")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines + [""]


def sweeps(results):
    """{backend: the all-reduce sweep run} for the sweeps that were fitted."""
    return {r["backend"]: r for r in ok_runs(results)
            if r["runner"] == "allreduce" and r.get("busbw")}


def _size(b):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b} B"


def _seconds(t):
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def projection_section(results):
    """The measured all-reduce sweeps, the model, and the projected efficiencies."""
    found = sweeps(results)
    lines = ["## Modelled, not measured: projected scaling efficiency past the GPUs we have",
             "", "The figures below come from a model fed with this run's measurements (its "
             "inputs: t_c from plain fit, M from the trainable parameters, alpha and busbw "
             "from the all-reduce sweep, the network's figures assumed); only the 'measured "
             "at 2' column is measured.", ""]
    if not found:
        failed = [r for r in results["runs"] if r["runner"] == "allreduce"]
        why = "; ".join(f"{r['backend']}: {_cell(r, lambda r: 'not fitted')}" for r in failed)
        return lines[:2] + ["No all-reduce sweep in these results" + (f" ({why})" if why else "")
                            + ": no projection (it needs a run on 2 or more GPUs).", ""]
    lines.append("All-reduce on the run's devices (time of one all-reduce; bus bandwidth "
                 "M/t x 2(p-1)/p):")
    lines.append("")
    for backend, r in sorted(found.items(), key=lambda kv: BACKEND_ORDER.get(kv[0], 9)):
        points = ", ".join(f"{_size(m)} {_seconds(t)}" for m, t in r["points"])
        lines.append(f"- {backend}, {r.get('method')}, p = {r['devices']}: fitted alpha "
                     f"{r['alpha_s'] * 1e6:.1f} us, busbw {r['busbw'] / 1e9:.1f} GB/s "
                     f"(largest message: {r['busbw_points'][-1] / 1e9:.1f} GB/s). {points}")
    lines += [""] + projection.describe(results.get("projection")) + [""]
    net = {k: v for k, v in (results.get("projection") or {}).items()}
    counts = projection.COUNTS
    runs = index(results)
    head = ("| workload | backend | policy | t_c (ms) | M | measured at 2 | "
            + " | ".join(f"{p}" for p in counts) + " |")
    lines += ["Efficiency without / with overlap of the all-reduce and the backward pass:", "",
              head, "|" + "---|" * (6 + len(counts))]
    for (backend, workload, runner, n, policy), plain in sorted(
            runs.items(), key=lambda kv: (workload_rank(kv[0][1]),
                                          BACKEND_ORDER.get(kv[0][0], 9))):
        if runner != "plain" or not plain.get("grad_bytes") or not plain.get("global_batch"):
            continue
        sweep = found.get(backend) or next(iter(found.values()))
        note = "" if sweep["backend"] == backend else f" ({sweep['backend']} sweep)"
        compute = plain["global_batch"] / plain["samples_per_s"]
        for pol in POLICIES:
            proj = projection.project(compute, plain["grad_bytes"], sweep["alpha_s"],
                                      sweep["busbw"], pol, counts, **net)
            k2 = runs.get((backend, workload, "kmgpu", 2, pol))
            measured = fmt(k2["vs_plain"] / 2, ".2f") if k2 and k2.get("vs_plain") else "-"
            cells = " | ".join(f"{a:.2f} / {b:.2f}" for a, b in (proj[p] for p in counts))
            lines.append(f"| {workload} | {backend}{note} | {pol} | {compute * 1e3:.2f} | "
                         f"{_size(plain['grad_bytes'])} | {measured} | {cells} |")
    return lines + [""]

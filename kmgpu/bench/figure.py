"""The results as one figure: samples/s against the number of devices, one panel per
workload, one colour per backend; kmgpu with each batch policy and the peer, beside the
ideal line (plain fit on one device x N)."""

from kmgpu.bench.tables import BACKEND_ORDER, index, ok_runs, workload_rank

COLOURS = {"tensorflow": "#ff7f0e", "jax": "#1f77b4", "torch": "#d62728"}
STYLES = {("kmgpu", "global"): ("-", "o", "kmgpu, global batch"),
          ("kmgpu", "per_replica"): ("--", "s", "kmgpu, per-replica batch"),
          ("peer", "global"): (":", "^", "peer, global batch")}


def plot(results, path=None, show=False):
    """Draw (and save to ``path``) the figure; returns it."""
    import matplotlib

    if path and not show:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = index(results)
    names = sorted({r["workload"] for r in ok_runs(results) if r["runner"] != "allreduce"},
                   key=workload_rank)
    cols = min(4, max(len(names), 1))
    rows = max(1, -(-len(names) // cols))
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(4.3 * cols, 3.6 * rows))
    simulated = bool(results.get("simulate")) or not (results.get("machine") or {}).get("gpus")
    unit = "devices (simulated)" if simulated else "GPUs"
    for i, workload in enumerate(names):
        ax = axes[i // cols][i % cols]
        backends = sorted({k[0] for k in runs if k[1] == workload}, key=BACKEND_ORDER.get)
        top = 1
        for backend in backends:
            colour = COLOURS.get(backend, "#555555")
            plain = runs.get((backend, workload, "plain", 1, "global"))
            for (runner, policy), (line, marker, label) in STYLES.items():
                pts = sorted((n, r["samples_per_s"]) for (b, w, ru, n, po), r in runs.items()
                             if (b, w, ru) == (backend, workload, runner)
                             and (po == policy or n == 1))
                if runner == "kmgpu" and policy == "per_replica" and len(pts) < 2:
                    continue
                if pts:
                    top = max(top, pts[-1][0])
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], line, marker=marker,
                            color=colour, label=f"{backend}: {label}")
            if plain:
                ax.plot([1], [plain["samples_per_s"]], "D", color=colour, mfc="white",
                        label=f"{backend}: plain fit")
            ref = runs.get((backend, workload, "reference", 1, "global"))
            if ref:
                ax.plot([1], [ref["samples_per_s"]], "*", ms=11, color="#2ca02c",
                        label="torchvision + PyTorch")
        for backend in backends:
            plain = runs.get((backend, workload, "plain", 1, "global"))
            if plain and top > 1:
                ax.plot([1, top], [plain["samples_per_s"], top * plain["samples_per_s"]],
                        color=COLOURS.get(backend, "#555555"), alpha=0.3, lw=4,
                        label=f"{backend}: ideal (plain x N)")
        ax.set_title(workload)
        ax.set_xlabel(unit)
        ax.set_ylabel("samples/s")
        ax.set_xticks(range(1, top + 1))
        values = [r["samples_per_s"] for k, r in runs.items() if k[1] == workload]
        if values and max(values) > 20 * min(values):
            ax.set_yscale("log")
    for j in range(len(names), rows * cols):
        axes[j // cols][j % cols].axis("off")
    legend = {}  # one legend for the figure: each label once
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    gpus = (results.get("machine") or {}).get("gpus") or []
    title = f"kmgpu bench {results.get('name', '')}" + (
        f" - {len(gpus)} x {gpus[0]}" if gpus and not results.get("simulate") else
        " - simulated devices share the CPU: not speedups")
    fig.suptitle(title)
    legend_rows = -(-len(legend) // 4)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=4, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, (0.2 * legend_rows + 0.15) / (3.6 * rows), 1, 1))
    if path:
        fig.savefig(path, dpi=110)
    if not show:
        plt.close(fig)
    return fig

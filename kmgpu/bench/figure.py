"""The leading table as one figure: one panel per model, one group of bars per backend:
plain fit on one device, kmgpu on one, and kmgpu on all devices where there are several
(with a tick at plain fit x N, the ideal)."""

from kmgpu.bench import summary
from kmgpu.bench.tables import BACKEND_ORDER, index, top_devices

COLOURS = {"tensorflow": "#ff7f0e", "jax": "#1f77b4", "torch": "#d62728"}


def plot(results, path=None, show=False):
    """Draw (and save to ``path``) the figure; returns it."""
    import matplotlib

    if path and not show:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = index(results)
    top = top_devices(results)
    names = [w for w in summary.workloads_in(results)
             if any(k[1] == w for k in runs)]
    cols = min(4, max(len(names), 1))
    rows = max(1, -(-len(names) // cols))
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(4.3 * cols, 3.6 * rows))
    simulated = bool(results.get("simulate")) or not (results.get("machine") or {}).get("gpus")
    unit = "device" if simulated else "GPU"
    bars = [("plain", 1, "plain fit, 1 " + unit, "white"), ("kmgpu", 1, "kmgpu, 1 " + unit, None)]
    if top > 1:
        bars.append(("kmgpu", top, f"kmgpu, {top} {unit}s", None))
    for i, workload in enumerate(names):
        ax = axes[i // cols][i % cols]
        backends = sorted({k[0] for k in runs if k[1] == workload},
                          key=lambda b: BACKEND_ORDER.get(b, 9))
        width = 0.8 / len(bars)
        for x, backend in enumerate(backends):
            colour = COLOURS.get(backend, "#555555")
            for j, (runner, n, label, face) in enumerate(bars):
                r = runs.get((backend, workload, runner, n, "global"))
                if r is None:
                    continue
                ax.bar(x + (j - (len(bars) - 1) / 2) * width, r["samples_per_s"], width,
                       color=face or colour, edgecolor=colour, alpha=1.0 if j < 2 else 0.6,
                       hatch="//" if j == 2 else None)
            plain = runs.get((backend, workload, "plain", 1, "global"))
            if plain and top > 1:
                x_top = x + (len(bars) - 1) / 2 * width
                ax.plot([x_top - width / 2, x_top + width / 2], [top * plain["samples_per_s"]] * 2,
                        color="black", lw=1.5)
        values = [r["samples_per_s"] for k, r in runs.items() if k[1] == workload]
        if values and max(values) > 20 * min(values):
            ax.set_yscale("log")
        ax.set_xticks(range(len(backends)))
        ax.set_xticklabels(backends)
        ax.set_title(workload)
        ax.set_ylabel("samples/s")
    for j in range(len(names), rows * cols):
        axes[j // cols][j % cols].axis("off")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=face or "#888888", edgecolor="#555555",
                     hatch="//" if j == 2 else None, label=label)
               for j, (_, _, label, face) in enumerate(bars)]
    if top > 1:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="black", label=f"plain fit x {top} (ideal)"))
    gpus = (results.get("machine") or {}).get("gpus") or []
    fig.suptitle(f"kmgpu bench {results.get('name', '')}" + (
        f" - {len(gpus)} x {gpus[0]}" if gpus and not results.get("simulate") else
        " - simulated devices share the CPU: a code-path check, not a speed"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.35 / (3.6 * rows), 1, 1))
    if path:
        fig.savefig(path, dpi=110)
    if not show:
        plt.close(fig)
    return fig

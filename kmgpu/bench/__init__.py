"""``kmgpu bench``: throughput, speedup, scaling efficiency, MFU, compile time, parity and
memory of kmgpu against plain ``model.fit`` and each framework's own data-parallel way.

    kmgpu bench --help          the options
    kmgpu bench --quick         CPU-sized, every workload (CI)

For notebooks and scripts: ``load_results()``, ``markdown(results)`` and ``plot(results)``
read and show results without running anything; ``main(argv)`` runs the command.
Results go to the repository's ``benchmarks/results`` in a source checkout, else to
``./kmgpu-bench``. Importing this package imports no backend.

Modules: ``workloads`` and ``models`` (what is trained), ``runners`` and ``ddp`` (kmgpu,
plain fit, the peers, the torchvision reference), ``allreduce`` (the all-reduce sweep),
``flops`` (FLOPs per sample, peaks, MFU), ``worker`` (one backend's runs in one process),
``processes`` (those processes, started and read from the command), ``plan`` (units of
runs, workload by workload, and the time budget), ``cli`` (options, progress bar), ``derive`` (ratios once all runs are in), ``projection``
(alpha-beta model of more GPUs), ``summary`` (the leading table: per model and backend),
``report``, ``tables`` and ``figure`` (JSON -> markdown and PNG), ``paths``.
"""

import glob
import json
import os

from kmgpu.bench import paths

RESULTS = paths.CHECKOUT_RESULTS


def main(argv=None):
    """Entry point of ``kmgpu bench``; returns the exit status."""
    from kmgpu.bench import cli

    return cli.main(argv)


def result_files(folder=None):
    """The results JSON files in ``folder`` (default: the checkout's benchmarks/results,
    else ./kmgpu-bench), newest run first (by the "created" they hold)."""
    folder = folder or paths.results_folder() or paths.default_out()

    def created(path):
        try:
            with open(path) as f:
                return json.load(f).get("created", "")
        except (OSError, ValueError):
            return ""

    files = [f for f in glob.glob(os.path.join(folder, "*.json"))
             if not f.endswith(".partial.json")]
    return sorted(files, key=created, reverse=True)


def load_results(path=None):
    """One results dict: ``path``, or the newest in ``result_files()``."""
    from kmgpu.bench import report

    if path is None:
        files = result_files()
        if not files:
            raise FileNotFoundError(
                f"no benchmark results in {paths.results_folder() or paths.default_out()}: "
                "run `kmgpu bench`.")
        path = files[0]
    return report.load(path)


def markdown(results):
    """The results as markdown: the table per model and backend first, then (several
    devices) the speedup table, backends, projection, kmgpu against plain fit and the
    peer, every run."""
    from kmgpu.bench import report

    return report.markdown(results)


def plot(results, path=None, show=False):
    """The results as a matplotlib figure (saved to ``path`` if given)."""
    from kmgpu.bench import report

    return report.plot(results, path, show=show)

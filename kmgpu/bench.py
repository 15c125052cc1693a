"""``kmgpu bench``: the benchmarks of ``benchmarks/`` in a source checkout.

The benchmark code (workloads, peers, report) lives in the repository's
``benchmarks/`` folder, next to its results; this module finds it and runs it.
``kmgpu bench --help`` lists the options; ``kmgpu bench --quick`` sizes it for a CPU.

Also for notebooks and scripts: ``load_results()``, ``markdown(results)`` and
``plot(results)`` read and show results without running anything.
"""

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(FOLDER, "results")


def _benchmarks():
    if not os.path.isfile(os.path.join(FOLDER, "main.py")):
        raise SystemExit(
            "kmgpu bench needs the benchmarks/ folder of a kmgpu source checkout "
            f"(looked in {FOLDER}): git clone the repository and `pip install -e .` there.")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import benchmarks.main
    import benchmarks.report

    return benchmarks


def main(argv=None):
    """Entry point of ``kmgpu bench``; returns the exit status."""
    return _benchmarks().main.main(argv)


def result_files(folder=RESULTS):
    """The results JSON files in ``folder``, newest run first (by the "created" they hold)."""
    import json

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
    """One results dict: ``path``, or the newest JSON in benchmarks/results."""
    report = _benchmarks().report
    if path is None:
        files = result_files()
        if not files:
            raise FileNotFoundError(f"no benchmark results in {RESULTS}: run `kmgpu bench`.")
        path = files[0]
    return report.load(path)


def markdown(results):
    """The results as markdown tables (kmgpu against plain fit and the peer; every run)."""
    return _benchmarks().report.markdown(results)


def plot(results, path=None, show=False):
    """The results as a matplotlib figure (saved to ``path`` if given)."""
    return _benchmarks().report.plot(results, path, show=show)

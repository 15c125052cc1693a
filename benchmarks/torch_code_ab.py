"""torch under kmgpu: one version of kmgpu against another, order-balanced, on the torch
default set: ResNet-50 64x64, EfficientNetB0, a BERT-style encoder, the bench's transformer
and a masked bidirectional GRU (``jax_balanced.py``'s models and runs: the first epoch,
a steady epoch, fit with validation, evaluate and predict, each on one device).

    git archive <commit> kmgpu | tar -x -C /tmp/before
    KERAS_BACKEND=torch python benchmarks/torch_code_ab.py --before /tmp/before
    python benchmarks/torch_code_ab.py --before /tmp/before --quick   # CPU sizes

One process per version and run, in the order before, after, after, before (``--pairs``
times): each version runs first once, and the two runs of a version give the noise that a
difference between the versions must beat. Prints a table: seconds (median [range]) per
model and measure for each version, and before / after (above 1: the after code is faster).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_SET = "resnet50_small,efficientnetb0,bert,transformer,gru"
VERSIONS = ("before", "after")


def run(folder, args):
    """One process of ``jax_balanced.py`` (kmgpu only) with ``folder``'s kmgpu first on the
    path. Returns its results, one per model."""
    cmd = [sys.executable, os.path.join(HERE, "jax_balanced.py"), "--variants", "kmgpu",
           "--child", "--models", args.models, "--rounds", str(args.rounds)]
    cmd += ["--steps", str(args.steps)] if args.steps else []
    cmd += ["--quick"] if args.quick else []
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([folder] + paths))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=folder)
    got = [json.loads(line[len("JAXBAL "):]) for line in proc.stdout.splitlines()
           if line.startswith("JAXBAL ")]
    if proc.returncode or not got:
        print((proc.stdout + proc.stderr)[-3000:], flush=True)
    return got


def main():
    sys.path.insert(0, HERE)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a folder holding the other kmgpu")
    p.add_argument("--after", default=ROOT, help="a folder holding this kmgpu (default: here)")
    p.add_argument("--models", default=DEFAULT_SET)
    p.add_argument("--pairs", type=int, default=1, help="times the order before, after, "
                   "after, before runs")
    p.add_argument("--rounds", type=int, default=2, help="steady epochs per process")
    p.add_argument("--steps", type=int, default=0, help="steps per epoch (0: the model's)")
    p.add_argument("--quick", action="store_true", help="CPU sizes")
    args = p.parse_args()
    import jax_balanced

    folders = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    pooled, order, start = {}, [], time.perf_counter()
    for _ in range(args.pairs):
        for version in ("before", "after", "after", "before"):
            t0 = time.perf_counter()
            for r in run(folders[version], args):
                if r["model"] not in pooled:
                    order.append(r["model"])
                    pooled[r["model"]] = dict(r, times={v: {m: [] for m in jax_balanced.MEASURES}
                                                        for v in VERSIONS})
                for m in jax_balanced.MEASURES:
                    pooled[r["model"]]["times"][version][m] += r["times"]["kmgpu"][m]
            print(f"{version}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"# torch_code_ab: before = {folders['before']}, after = {folders['after']}; "
          f"{4 * args.pairs} processes, {args.rounds} steady rounds each; seconds\n")
    print(jax_balanced.table([pooled[m] for m in order], list(VERSIONS)))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""A call's arrays copied to the GPU before the steps, or in chunks beside them
(``engines/torch/data/resident.py``). A script that prints a Markdown table, not a test.

    KERAS_BACKEND=torch python benchmarks/lab/torch_resident.py [--quick]
        [--models efficientnetb0,resnet50] [--steps 10] [--rounds 3]

Per model (torch_kernels.py's: EfficientNetB0 224 batch 64, ResNet-50 64x64 batch 256),
one process, ``kmgpu.parallelize(model, gpus=1)``, the default captured step: a
``fit(epochs=1)`` of ``--steps`` batches (the steady epoch of ``backends_balanced.py``)
timed to the GPU's end, in the order before, after, after, before per round, after two
untimed calls of each. "before": ``resident.CHUNK_BYTES`` larger than the arrays (one
copy before the first step, kmgpu's way before this change); "after": the default chunks.
Same weights either way (the rows are the same); the table gives ms per call and
samples/s (medians over the rounds).
"""

import argparse
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "lab"))
os.environ.setdefault("KERAS_BACKEND", "torch")

import torch_kernels as tk  # noqa: E402 (the models and batches)


def run_model(name, quick, steps, rounds):
    import numpy as np
    import torch

    import kmgpu
    from kmgpu.engines.torch.data import resident

    xn, yn = tk.batch_arrays(name, quick)
    x, y = np.concatenate([xn] * steps), np.concatenate([yn] * steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-device note
        parallel = kmgpu.parallelize(tk.compiled(name, quick), gpus=1)
    default = resident.CHUNK_BYTES

    def call(variant):
        resident.CHUNK_BYTES = x.nbytes + y.nbytes + 1 if variant == "before" else default
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kmgpu's few-steps note
            parallel.fit(x, y, batch_size=len(xn), epochs=1, shuffle=False, verbose=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for variant in ("before", "after") * 2:
        call(variant)
    got = {"before": [], "after": []}
    for _ in range(rounds):
        for variant in ("before", "after", "after", "before"):
            got[variant].append(call(variant))
    resident.CHUNK_BYTES = default
    parallel.close()
    return {"desc": tk.spec(name, quick)[0], "rows": len(x), "batch": len(xn),
            "mb": (x.nbytes + y.nbytes) / 2**20, "times": got}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="efficientnetb0,resnet50")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    lines = ["| model | rows (MB) | before: ms per call | after: ms per call | before -> after "
             "samples/s |", "|---|---|---|---|---|"]
    for name in a.models.split(","):
        r = run_model(name, a.quick, a.steps, a.rounds)
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        lines.append(
            f"| {r['desc']}, batch {r['batch']} | {r['rows']} ({r['mb']:.0f}) | "
            + " | ".join(f"{med[k] * 1e3:.1f} [" + ", ".join(f"{t * 1e3:.1f}" for t in r["times"][k])
                         + "]" for k in ("before", "after"))
            + f" | {r['rows'] / med['before']:,.0f} -> {r['rows'] / med['after']:,.0f} |")
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

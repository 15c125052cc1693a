"""Where kmgpu's ``fit`` loses time beside its step, on one device: a cost per step and a
cost per epoch, told apart by epochs of two lengths. A script that prints a Markdown table,
not a test.

    KERAS_BACKEND=torch python benchmarks/lab/fit_gap.py [--quick] [--epochs 6]
        [--workloads transformer,resnet50_small] [--out DIR]

For each of the bench's workloads (``kmgpu/bench/workloads.py``), in one process: a model
through ``kmgpu.parallelize(model, gpus=1)``, its warm-up (``runners._warm_up``), then
``--epochs`` epochs of one ``fit`` at the workload's steps per epoch (S) and as many at 4 x S
on the same model, in the order S, 4S, S, 4S (order-balanced: two medians of each, the
fit calls alternating). With T(S) the median epoch at S steps::

    per step   (T(4S) - T(S)) / 3S      what each step costs inside fit
    per epoch  T(S) - S x per step       what each epoch costs beside its steps (setting up
                                         its iterator, the callbacks, the sync at its end)

The bench's epochs are S steps long: ``per epoch / S`` is what that adds to each of its steps.
Run under each backend to compare (torch: kmgpu's captured step; JAX: the user's fit).
On a CPU (``--quick``) the figures test the script, nothing to read.
"""

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def epoch_seconds(fit, x, y, batch, epochs):
    from kmgpu.callbacks import EpochTimer

    timer = EpochTimer()
    fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
    return timer.epoch_seconds


def measure(name, quick, epochs):
    import warnings

    import kmgpu
    from kmgpu.bench import runners, workloads

    w = workloads.get(name, quick=quick)
    long_ = dataclasses.replace(w, steps=4 * w.steps)
    (x, y), (xl, yl) = w.data(), long_.data()
    model = w.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "one device: a single replica"
        parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(**runners.compile_args(w))
    runners._warm_up(parallel.fit, model, x, y, w.batch, w.steps, quick=quick)
    short, long_s = [], []
    for _ in range(2):
        short += epoch_seconds(parallel.fit, x, y, w.batch, epochs)
        long_s += epoch_seconds(parallel.fit, xl, yl, w.batch, epochs)
    t1, t4 = statistics.median(short), statistics.median(long_s)
    step = (t4 - t1) / (3 * w.steps)
    fixed = t1 - w.steps * step
    return {"workload": name, "batch": w.batch, "steps": w.steps, "t1": t1, "t4": t4,
            "step_ms": step * 1e3, "epoch_ms": fixed * 1e3,
            "added_ms": fixed * 1e3 / w.steps, "sps1": w.batch * w.steps / t1,
            "sps4": 4 * w.batch * w.steps / t4}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--workloads", default="transformer,resnet50_small")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import keras

    rows = [measure(n, args.quick, args.epochs) for n in args.workloads.split(",")]
    backend = keras.config.backend()
    lines = [f"# kmgpu's fit on one device: cost per step and per epoch ({backend})", "",
             f"Keras {keras.__version__}; {args.epochs} epochs a call, S and 4S alternating "
             f"twice; `KERAS_BACKEND={backend} python3 benchmarks/lab/fit_gap.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| workload | batch | S | epoch at S (s) | epoch at 4S (s) | per step (ms) | "
             "per epoch beside the steps (ms) | that per step at S (ms) | samples/s at S | "
             "at 4S |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| {workload} | {batch} | {steps} | {t1:.4f} | {t4:.4f} | {step_ms:.3f} | "
                     "{epoch_ms:.2f} | {added_ms:.3f} | {sps1:,.0f} | {sps4:,.0f} |".format(**r))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"fit-gap-{backend}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

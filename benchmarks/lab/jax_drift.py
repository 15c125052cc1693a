"""Why plain fit again is slower than plain fit on JAX's ResNet-50 64x64: one model's
epochs timed in phases of one process, each phase changing one thing. A script that
prints a Markdown table, not a test.

    KERAS_BACKEND=jax python benchmarks/lab/jax_drift.py [--quick] [--epochs 8]
        [--workload resnet50_small] [--out DIR]

Phases, in this order, in one process, model A throughout unless named:

    A                 plain fit after the bench's own warm-up (``runners._warm_up``)
    A after infer     after A's evaluate and predict (their compiles), as the bench does
    B kmgpu           a second model of the same workload through ``kmgpu.parallelize``,
                      after its warm-up, evaluate and predict (as the bench's kmgpu run)
    A, B alive        A again, B and its ParallelModel still referenced
    A, B freed        A again after B is dropped and garbage collected
    A, gc frozen      A again after ``gc.freeze()`` (earlier objects out of GC's scans)
    A again           A again, last: is the slow-down a matter of time alone?

Each phase: ``--epochs`` epochs of one ``fit`` call, timed by ``EpochTimer``; the median,
min and max epoch; NVML's SM clock, temperature, power and utilisation read after it.
JAX's persistent compilation cache is on (in a temporary folder), as in the bench's
workers, and each phase (its warm-up and evaluate and predict included) says what it
compiled and what it loaded, and which parts of its train step's cache key differ from
A's.
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def nvml_reading():
    """The first GPU's SM clock, temperature, power and utilisation now ({} without NVML)."""
    from kmgpu.callbacks import NvmlUnavailable, _nvml

    try:
        nvml = _nvml()
    except NvmlUnavailable:
        return {}
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        return {"sm_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                "temp_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "util": nvml.nvmlDeviceGetUtilizationRates(h).gpu}
    finally:
        nvml.nvmlShutdown()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--workload", default="resnet50_small")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from kmgpu.bench import compile_log

    compile_log.share_compiled_code(tempfile.mkdtemp())  # before any compile, as a worker
    import keras

    import kmgpu
    from kmgpu.bench import runners, workloads
    from kmgpu.callbacks import EpochTimer

    w = workloads.get(args.workload, quick=args.quick, devices=1)
    x, y = w.data()
    rows, keys = [], {}

    def timed(fit, phase):
        timer = EpochTimer()
        start = time.perf_counter()
        fit(x, y, batch_size=w.batch, epochs=args.epochs, shuffle=False, verbose=0,
            callbacks=[timer])
        wall = time.perf_counter() - start
        s = timer.epoch_seconds
        compiles = compile_log.LOG.take()
        key = compiles.get("train_step_key") or {}
        keys.setdefault("A", key)
        rows.append({"phase": phase, "median": statistics.median(s), "min": min(s),
                     "max": max(s), "wall": wall, "objects": len(gc.get_objects()),
                     "compile_s": compiles.get("compile_s", 0.0),
                     "hits": compiles.get("cache_hits", 0),
                     "misses": compiles.get("cache_misses", 0),
                     "key_differs": ", ".join(k for k in key if key[k] != keys["A"].get(k))
                     or "-", **nvml_reading()})
        print(rows[-1], flush=True)

    a = w.build()
    a.compile(**w.compile_args())
    runners._warm_up(a.fit, a, x, y, w.batch, w.steps, quick=args.quick)
    timed(a.fit, "A")
    runners._infer(a, x, y, w.batch)
    timed(a.fit, "A after infer")
    b = w.build()
    parallel = kmgpu.parallelize(b, gpus=1 if not args.quick else None)
    parallel.compile(**w.compile_args())
    runners._warm_up(parallel.fit, b, x, y, w.batch, w.steps, quick=args.quick)
    runners._infer(parallel, x, y, w.batch)  # its compiles (or loads) count in B's row
    timed(parallel.fit, "B kmgpu")
    timed(a.fit, "A, B alive")
    del b, parallel
    gc.collect()
    timed(a.fit, "A, B freed")
    gc.collect()
    gc.freeze()
    timed(a.fit, "A, gc frozen")
    gc.unfreeze()
    timed(a.fit, "A again")

    first = rows[0]["median"]
    lines = [f"# JAX epoch time by phase, one process: {w.description}",
             "",
             f"Keras {keras.__version__}, {keras.config.backend()}, batch {w.batch}, "
             f"{w.steps} steps an epoch, {args.epochs} epochs a phase; "
             f"`python3 benchmarks/lab/jax_drift.py {' '.join(argv or sys.argv[1:])}`",
             "",
             "| phase | median epoch (s) | min | max | vs A | SM MHz | temp C | power W | "
             "util % | GC objects | compiled (s) | cache hits | misses | train step key "
             "differs from A's in |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| {phase} | {median:.4f} | {min:.4f} | {max:.4f} | {ratio:+.1%} | "
                     "{sm} | {temp} | {power} | {util} | {objects:,} | {compile_s:.1f} | "
                     "{hits} | {misses} | {key_differs} |".format(**{
                         **r, "ratio": r["median"] / first - 1, "sm": r.get("sm_mhz", "-"),
                         "temp": r.get("temp_c", "-"),
                         "power": f"{r['power_w']:.0f}" if "power_w" in r else "-",
                         "util": r.get("util", "-")}))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "jax-drift.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

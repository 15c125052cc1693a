"""TensorFlow engine: what one more call costs, kmgpu on 4 simulated devices against plain
Keras on one, in the same process.

- fits: ten ``fit(epochs=1)`` against one ``fit(epochs=10)`` (MLP 64-512-512-10, Adam,
  256 rows in batches of 64), shuffled (Keras's default, under a global seed) and not.
  Target: kmgpu's ratio <= 1.1 x max(1, plain's ratio).
- on_batch: thirty ``train_on_batch`` calls against one 30-step ``fit`` over the same
  batches (1,920 rows, shuffle=False). Target: kmgpu's ratio <= 3 x plain's.

Each case has its own plain model and ParallelModel (kmgpu keeps one training input per
model; the cases train on different arrays). Order-balanced: each round runs plain then
kmgpu, the next kmgpu then plain, and within a runner the order of the two sides of a
ratio alternates too; every figure is a median over the rounds, after one warm-up call
of each kind. ``--before DIR`` runs the same
measure with the kmgpu of another checkout (DIR holds its ``kmgpu/``), one process per
run, alternating before, after, before, after.

    KERAS_BACKEND=tensorflow python benchmarks/tf_per_call.py --rounds 3
    python benchmarks/tf_per_call.py --before /tmp/tf_before --out benchmarks/results/tf-per-call.md
    python benchmarks/tf_per_call.py --profile fit-shuffled   # cProfile of kmgpu's calls
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES, CALLS, STEPS, BATCH = 4, 10, 30, 64
CASES = ("fit-shuffled", "fit-unshuffled", "on_batch")


def _mlp(keras):
    keras.utils.set_random_seed(1)  # also the global seed a shuffled fit reads
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def _sides(runner, x, y, case):
    """The two sides of one case's ratio: (many calls, one call)."""
    if case == "on_batch":
        def many():
            for s in range(STEPS):
                runner.train_on_batch(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])

        def one():
            runner.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return many, one
    rows, shuffle = 4 * BATCH, case == "fit-shuffled"

    def many():
        for _ in range(CALLS):
            runner.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=1, shuffle=shuffle,
                       verbose=0)

    def one():
        runner.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=CALLS, shuffle=shuffle,
                   verbose=0)
    return many, one


def measure(rounds, profile=None):
    """In this process: {case: {"plain": {...}, "kmgpu": {...}}}."""
    import warnings

    import numpy as np

    import kmgpu

    kmgpu.simulate_devices(DEVICES)
    import keras

    warnings.simplefilter("ignore")  # kmgpu's note about few steps per epoch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 64)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 10)).astype("float32")
    runners = {}  # a runner per case: kmgpu keeps one training input, a case's own
    for which in ("plain", "kmgpu"):
        for case in CASES:
            model = _mlp(keras)
            model.compile(optimizer="adam", loss="mse")
            runners[(which, case)] = model if which == "plain" else kmgpu.parallelize(
                model, gpus=DEVICES)
    sides = {key: _sides(r, x, y, key[1]) for key, r in runners.items()}
    for fns in sides.values():  # warm-up: traces, iterators, first copies
        for fn in fns:
            fn()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        sides[("kmgpu", profile)][0]()
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
        return {}
    times = {c: {w: {"many": [], "one": []} for w in ("plain", "kmgpu")} for c in CASES}
    for r in range(rounds):
        for which in (("plain", "kmgpu") if r % 2 == 0 else ("kmgpu", "plain")):
            for case in CASES:
                many, one = sides[(which, case)]
                for name, fn in ((("many", many), ("one", one)) if r % 2 == 0
                                 else (("one", one), ("many", many))):
                    start = time.perf_counter()
                    fn()
                    times[case][which][name].append(time.perf_counter() - start)
    out = {"kmgpu_from": os.path.dirname(os.path.dirname(os.path.abspath(kmgpu.__file__)))}
    for case, per in times.items():
        out[case] = {}
        for which, t in per.items():
            many, one = float(np.median(t["many"])), float(np.median(t["one"]))
            out[case][which] = {"many_s": many, "one_s": one, "ratio": many / one}
    for case in CASES:
        runners[("kmgpu", case)].close()
    return out


def run_child(code, rounds):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=code + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code)
    for line in proc.stdout.splitlines():
        if line.startswith("TF_PER_CALL "):
            return json.loads(line[len("TF_PER_CALL "):])
    return {"error": (proc.stdout + proc.stderr)[-2000:]}


def table(runs):
    """runs: [(label, result)] -> Markdown lines."""
    lines = ["| run | case | kmgpu: many / one | plain: many / one | target | met? "
             "| kmgpu many, s | kmgpu one, s |", "|---|---|---|---|---|---|---|---|"]
    for label, result in runs:
        if "error" in result:
            lines.append(f"| {label} | error | | | | | | |")
            continue
        label = f"{label} ({result['kmgpu_from']})"
        for case in CASES:
            k, p = result[case]["kmgpu"], result[case]["plain"]
            target = 3 * p["ratio"] if case == "on_batch" else 1.1 * max(1.0, p["ratio"])
            lines.append(f"| {label} | {case} | {k['ratio']:.2f}x | {p['ratio']:.2f}x "
                         f"| <= {target:.2f}x | {'met' if k['ratio'] <= target else 'missed'} "
                         f"| {k['many_s']:.3f} | {k['one_s']:.3f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="a checkout of the code before (holds kmgpu/)")
    parser.add_argument("--profile", choices=CASES)
    parser.add_argument("--out", help="also write the table here (Markdown)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child or args.profile:
        result = measure(args.rounds, args.profile)
        if args.child:
            print("TF_PER_CALL " + json.dumps(result), flush=True)
        return
    codes = [("after", ROOT)]
    if args.before:
        codes = [("before", os.path.abspath(args.before)), ("after", ROOT)] * 2
    runs = [(label, run_child(code, args.rounds)) for label, code in codes]
    lines = table(runs)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

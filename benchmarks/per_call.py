"""What one more ``fit`` call costs: 10 x fit(epochs=1) / fit(epochs=10), kmgpu and plain Keras.

Notebook users call ``fit`` again and again; each call's set-up (kmgpu: copying the
weights in and out, the engine's own set-up) should cost no more than plain Keras's
own per-call cost. The ratio is 1.0 when a call costs nothing beyond its epochs.
Target (issue 30): kmgpu's ratio <= 1.1 x max(1, plain Keras's ratio).

The workload: a 34M-parameter MLP (4096 -> 4096 -> 4096 -> 16), one step per epoch
(``--rows`` rows, the global batch), kmgpu on 4 simulated devices (CPU), plain Keras on
one. One process per backend (KERAS_BACKEND is fixed per process); in each, after one
warm-up call of each kind, the rounds alternate plain and kmgpu, and within a round
the order of the 10-epoch fit and the ten 1-epoch fits alternates too; the ratio is
median(ten 1-epoch fits) / median(one 10-epoch fit) over the rounds.

    python benchmarks/per_call.py                       # tensorflow, jax, torch
    python benchmarks/per_call.py --backends torch --rounds 3 --rows 64
    python benchmarks/per_call.py --profile torch       # cProfile of kmgpu's 1-epoch fits

Prints one table (and --out writes it as Markdown).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("tensorflow", "jax", "torch")
WIDTH, CLASSES, DEVICES, CALLS = 4096, 16, 4, 10


def build(keras, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((WIDTH,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def measure(rows, rounds, profile=None):
    """In this process (its KERAS_BACKEND): {"plain": ratio, "kmgpu": ratio, ...}."""
    import warnings

    import numpy as np

    import kmgpu

    kmgpu.simulate_devices(DEVICES)
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, WIDTH)).astype("float32")
    y = rng.integers(0, CLASSES, size=(rows,)).astype("int32")
    fitters = {}
    plain = build(keras)
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    fitters["plain"] = plain
    model = build(keras)
    parallel = kmgpu.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    fitters["kmgpu"] = parallel
    params = plain.count_params()

    def fit(which, epochs):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kmgpu's note about one step per epoch
            fitters[which].fit(x, y, batch_size=rows, epochs=epochs, shuffle=False, verbose=0)
        return time.perf_counter() - start

    for which in fitters:  # warm-up: compile, start workers, first copies
        fit(which, 1)
        fit(which, 1)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            fit("kmgpu", 1)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(45)
        return {}
    times = {w: {"one": [], "ten": []} for w in fitters}
    for r in range(rounds):
        for which in (("plain", "kmgpu") if r % 2 == 0 else ("kmgpu", "plain")):
            order = ("ten", "one") if r % 2 == 0 else ("one", "ten")
            for kind in order:
                if kind == "ten":
                    times[which]["ten"].append(fit(which, CALLS))
                else:
                    times[which]["one"].append(sum(fit(which, 1) for _ in range(CALLS)))
    out = {"params": params, "rows": rows, "rounds": rounds}
    for which, t in times.items():
        one, ten = float(np.median(t["one"])), float(np.median(t["ten"]))
        out[which] = {"ratio": one / ten, "one_s": one, "ten_s": ten}
    parallel.close()
    return out


def run_backend(backend, args):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rows", str(args.rows),
           "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("PER_CALL "):
            return json.loads(line[len("PER_CALL "):])
    return {"error": (proc.stdout + proc.stderr)[-2000:]}


def table(results):
    lines = ["| backend | kmgpu: 10 x fit(epochs=1) / fit(epochs=10) | plain Keras: the same "
             "| target: kmgpu <= 1.1 x max(1, plain) | met? | kmgpu 10 x 1 epoch, s "
             "| kmgpu 10 epochs, s |",
             "|---|---|---|---|---|---|---|"]
    for backend, r in results.items():
        if "error" in r:
            lines.append(f"| {backend} | error | | | | | |")
            continue
        k, p = r["kmgpu"], r["plain"]
        target = 1.1 * max(1.0, p["ratio"])
        met = "met" if k["ratio"] <= target else "**missed**"
        lines.append(f"| {backend} | {k['ratio']:.2f}x | {p['ratio']:.2f}x | <= {target:.2f}x "
                     f"| {met} | {k['one_s']:.2f} | {k['ten_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--rows", type=int, default=64, help="rows = the global batch (1 step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", metavar="BACKEND", help="cProfile kmgpu's 1-epoch fits")
    p.add_argument("--out", help="also write the table to this Markdown file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("PER_CALL " + json.dumps(measure(args.rows, args.rounds)), flush=True)
        return 0
    if args.profile:
        os.environ["KERAS_BACKEND"] = args.profile
        measure(args.rows, args.rounds, profile=True)
        return 0
    results = {}
    for backend in args.backends.split(","):
        start = time.perf_counter()
        results[backend] = run_backend(backend, args)
        r = results[backend]
        print(f"{backend}: {time.perf_counter() - start:.0f} s"
              + (f" - error:\n{r['error']}" if "error" in r else ""), flush=True)
    text = (f"Per-call cost, {DEVICES} simulated devices (CPU), the 34M-parameter MLP, "
            f"{args.rows} rows = one step per epoch, median of {args.rounds} rounds:\n\n"
            + table(results))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

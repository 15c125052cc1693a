"""What one more ``fit`` call costs: 10 x fit(epochs=1) / fit(epochs=10), kmgpu and plain Keras.

Notebook users call ``fit`` again and again; each call's set-up (kmgpu: copying the
weights in and out, the engine's own set-up) should cost no more than plain Keras's
own per-call cost. The ratio is 1.0 when a call costs nothing beyond its epochs.
Target: kmgpu's ratio <= 1.1 x max(1, plain Keras's ratio).

The workload: a 34M-parameter MLP (4096 -> 4096 -> 4096 -> 16), one step per epoch
(``--rows`` rows, the global batch), kmgpu on 4 simulated devices (CPU), plain Keras on
one. One process per backend (KERAS_BACKEND is fixed per process); in each, after one
warm-up call of each kind, the rounds alternate plain and kmgpu, and within a round
the order of the 10-epoch fit and the ten 1-epoch fits alternates too; the ratio is
median(ten 1-epoch fits) / median(one 10-epoch fit) over the rounds. Beside it, the same
ratio of the process's CPU time (all threads), which other jobs on a shared machine move
less than wall time.

    python benchmarks/per_call.py                       # tensorflow, jax, torch
    python benchmarks/per_call.py --backends torch --rounds 3 --rows 64
    python benchmarks/per_call.py --profile torch       # cProfile of kmgpu's 1-epoch fits
    python benchmarks/per_call.py --backends jax --before /old/checkout   # before / after

``--copy-back N`` (JAX): only kmgpu's copy of the trained state back into the template
after a fit (``JaxEngine.copy_back`` + ``note_synced``, waited for), N times each way in
one process, alternating: every array through one batched ``device_put`` into fresh
buffers (``REUSE_BYTES`` = infinity) against large arrays written into the template's own
buffers (kmgpu's way).

``--before DIR``: the same measure with the kmgpu of another checkout (DIR holds its
``kmgpu/``), one process per run, alternating: before, after, before, after; each row
is the median over its two processes, each process's ratio beside it.

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

    cpu = {w: {"one": [], "ten": []} for w in fitters}  # this process's CPU time, beside

    def fit(which, epochs, kind=None):
        start, start_cpu = time.perf_counter(), time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kmgpu's note about one step per epoch
            fitters[which].fit(x, y, batch_size=rows, epochs=epochs, shuffle=False, verbose=0)
        if kind == "ten":
            cpu[which]["ten"].append(time.process_time() - start_cpu)
        elif kind == "one":
            cpu[which]["one"][-1] += time.process_time() - start_cpu
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
                    times[which]["ten"].append(fit(which, CALLS, kind))
                else:
                    cpu[which]["one"].append(0.0)
                    times[which]["one"].append(sum(fit(which, 1, kind) for _ in range(CALLS)))
    out = {"params": params, "rows": rows, "rounds": rounds,
           "kmgpu_from": os.path.dirname(os.path.dirname(os.path.abspath(kmgpu.__file__)))}
    for which, t in times.items():
        one, ten = float(np.median(t["one"])), float(np.median(t["ten"]))
        out[which] = {"ratio": one / ten, "one_s": one, "ten_s": ten,
                      "cpu_ratio": float(np.median(cpu[which]["one"]))
                      / float(np.median(cpu[which]["ten"]))}
    parallel.close()
    return out


def copy_back(rows, rounds):
    """--copy-back: seconds per copy back, fresh buffers against the template's own."""
    import warnings

    import numpy as np

    import kmgpu

    kmgpu.simulate_devices(DEVICES)
    import jax
    import keras

    from kmgpu.engines import replication
    from kmgpu.engines.jax import engine

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, WIDTH)).astype("float32")
    y = rng.integers(0, CLASSES, size=(rows,)).astype("int32")
    model = build(keras)
    parallel = kmgpu.parallelize(model, gpus=DEVICES)
    parallel.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
    eng, reuse = parallel._engine, engine.REUSE_BYTES
    back = replication.state_pairs(eng.replica, model)
    times = {"fresh buffers (before)": [], "template's own buffers (now)": []}
    ways = list(times)
    for i in range(rounds + 1):
        for way in (ways if i % 2 == 0 else ways[::-1]):
            engine.REUSE_BYTES = float("inf") if way == ways[0] else reuse
            start = time.perf_counter()
            eng.copy_back(back)
            eng.note_synced([(t, r) for r, t in back])
            jax.block_until_ready([v.value for v in model.variables])
            if i:  # round 0 warms both up (the donated copy compiles once)
                times[way].append(time.perf_counter() - start)
    engine.REUSE_BYTES = reuse
    exact = all(np.array_equal(a, b) for a, b in
                zip(model.get_weights(), eng.replica.get_weights()))
    mb = sum(t.value.nbytes for _, t in back) / 2 ** 20
    lines = [f"copy back of {len(back)} arrays ({mb:.0f} MB: weights + Adam), {rounds} rounds "
             f"alternating; the template equals the replica after: {exact}", "",
             "| copy back | median s | min-max s |", "|---|---|---|"]
    for way, t in times.items():
        lines.append(f"| {way} | {np.median(t):.3f} | {min(t):.3f}-{max(t):.3f} |")
    return "\n".join(lines)


def run_backend(backend, args, code=ROOT):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=code + os.pathsep
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
             "| kmgpu 10 epochs, s | CPU-time ratios: kmgpu, plain |",
             "|---|---|---|---|---|---|---|---|"]
    for backend, r in results.items():
        if "error" in r:
            lines.append(f"| {backend} | error | | | | | | |")
            continue
        k, p = r["kmgpu"], r["plain"]
        target = 1.1 * max(1.0, p["ratio"])
        met = "met" if k["ratio"] <= target else "**missed**"
        lines.append(f"| {backend} | {k['ratio']:.2f}x | {p['ratio']:.2f}x | <= {target:.2f}x "
                     f"| {met} | {k['one_s']:.2f} | {k['ten_s']:.2f} "
                     f"| {_cpu([r], 'kmgpu')}, {_cpu([r], 'plain')} |")
    return "\n".join(lines)


def compare(backends, args):
    """--before: per backend, processes before, after, before, after; the table of both."""
    import statistics

    lines = ["| backend | code | kmgpu ratio: median [per process] | plain ratio: median "
             "[per process] | target: kmgpu <= 1.1 x max(1, plain) | met? "
             "| kmgpu 10 x 1 epoch, s | kmgpu 10 epochs, s | CPU-time ratios: kmgpu, plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for backend in backends:
        runs = {"before": [], "after": []}
        for which in ("before", "after", "before", "after"):
            start = time.perf_counter()
            r = run_backend(backend, args, os.path.abspath(args.before) if which == "before"
                            else ROOT)
            print(f"{backend} {which}: {time.perf_counter() - start:.0f} s"
                  + (f" - error:\n{r['error']}" if "error" in r else
                     f", kmgpu {r['kmgpu']['ratio']:.3f}x, plain {r['plain']['ratio']:.3f}x"
                     f" (kmgpu from {r.get('kmgpu_from')})"),
                  flush=True)
            if "error" not in r:
                runs[which].append(r)
        for which, rs in runs.items():
            if not rs:
                lines.append(f"| {backend} | {which} | error | | | | | | |")
                continue
            k = [r["kmgpu"]["ratio"] for r in rs]
            p = [r["plain"]["ratio"] for r in rs]
            target = 1.1 * max(1.0, statistics.median(p))
            met = "met" if statistics.median(k) <= target else "**missed**"
            one = statistics.median(r["kmgpu"]["one_s"] for r in rs)
            ten = statistics.median(r["kmgpu"]["ten_s"] for r in rs)
            lines.append(
                f"| {backend} | {which} | {statistics.median(k):.3f}x "
                f"[{', '.join(f'{a:.3f}' for a in k)}] | {statistics.median(p):.3f}x "
                f"[{', '.join(f'{a:.3f}' for a in p)}] | <= {target:.2f}x | {met} "
                f"| {one:.2f} | {ten:.2f} | {_cpu(rs, 'kmgpu')}, {_cpu(rs, 'plain')} |")
    return "\n".join(lines)


def _cpu(runs, which):
    """The median CPU-time ratio over ``runs`` (this process's CPU seconds, all threads:
    less moved than wall time by other jobs on a shared machine)."""
    import statistics

    ratios = [r[which]["cpu_ratio"] for r in runs if "cpu_ratio" in r[which]]
    return f"{statistics.median(ratios):.3f}x" if ratios else "-"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--rows", type=int, default=64, help="rows = the global batch (1 step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", metavar="BACKEND", help="cProfile kmgpu's 1-epoch fits")
    p.add_argument("--out", help="also write the table to this Markdown file")
    p.add_argument("--copy-back", type=int, default=0, metavar="N",
                   help="JAX: time only the copy back, N rounds each way (see above)")
    p.add_argument("--before", metavar="DIR",
                   help="also measure the kmgpu in DIR: processes before, after, before, after")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("PER_CALL " + json.dumps(measure(args.rows, args.rounds)), flush=True)
        return 0
    if args.profile:
        os.environ["KERAS_BACKEND"] = args.profile
        measure(args.rows, args.rounds, profile=True)
        return 0
    if args.copy_back:
        os.environ["KERAS_BACKEND"] = "jax"
        text = copy_back(args.rows, args.copy_back)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 0
    if args.before:
        text = (f"Per-call cost before ({args.before}) and after (this checkout), "
                f"{DEVICES} simulated devices (CPU), the 34M-parameter MLP, {args.rows} rows "
                f"= one step per epoch, {args.rounds} rounds per process, one process per "
                "run (before, after, before, after):\n\n"
                + compare(args.backends.split(","), args))
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
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

"""Where one Keras/JAX training step's time goes, at the workload's batch B and at B/2,
on one device. A script that prints a Markdown table, not a test.

    KERAS_BACKEND=jax python benchmarks/jax_step_profile.py [--quick] [--workloads ...]
        [--variants fit,sync,iter,loop,trace,spe8] [--out FILE.md]

Per workload and batch, in one process, one model (same initial weights):

    fit       plain ``model.fit`` as ``kmgpu bench`` runs it (verbose=0, EpochTimer +
              GPUMonitor): ms per step, median epoch after the first
    sync      the same fit with one callback that has ``on_train_batch_end``: Keras then
              reads every step's logs on the main thread (no async dispatch): dispatch
              and device time in series
    iter      Keras's epoch iterator alone (array slicing + device_put, one batch
              ahead), ms per batch
    loop      Keras's own jitted train step in a hand loop on one device-resident batch
              (no iterator, no callbacks): ms per step
    dispatch  host time of one such call with an empty queue (flattening ~1000 state
              arrays, launching): ms
    device    GPU busy time per step from a ``jax.profiler`` trace of the hand loop
              (union of kernel intervals; "-" without a GPU trace)
    spe8      plain fit compiled with ``steps_per_execution=8``

Plain Keras only: kmgpu against plain fit is ``benchmarks/jax_balanced.py`` (order-
balanced); timing kmgpu after plain in one process would favour kmgpu (warm caches).

Each figure is the median over epochs after the first (the first compiles), so every
variant is timed after its own warm-up.
"""

import argparse
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("KERAS_BACKEND", "jax")

WORKLOADS = ("resnet50_small", "transformer", "efficientnetb0", "lstm")
VARIANTS = ("fit", "sync", "iter", "loop", "trace", "spe8")


def workload(name, quick, steps, epochs):
    from kmgpu.bench import workloads

    if name == "efficientnetb0":
        base = workloads.get("resnet50", quick)
        w = dataclasses.replace(
            base, name="efficientnetb0", batch=base.batch if quick else 64,
            builder=base.builder if quick else "application",
            args=base.args if quick else (("classes", 1000), ("image", 224),
                                          ("name", "EfficientNetB0")),
            input_shape=base.input_shape if quick else (224, 224, 3),
            classes=base.classes if quick else 1000,
            description="keras.applications.EfficientNetB0 224x224, 1000 classes")
    else:
        w = workloads.get(name, quick)
    return dataclasses.replace(w, steps=steps or w.steps, epochs=epochs or max(w.epochs, 3))


def median_steady(seconds):
    steady = seconds[1:] or seconds
    return statistics.median(steady)


def timed_fit(model, x, y, batch, epochs, extra=()):
    from kmgpu.callbacks import EpochTimer, GPUMonitor

    timer = EpochTimer(len(x))
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[timer, GPUMonitor(interval=0.2, verbose=0), *extra])
    steps = -(-len(x) // batch)
    return 1e3 * median_steady(timer.epoch_seconds) / steps


class EveryStep:
    """A callback with a batch hook: Keras turns off its async callback dispatch."""

    def __new__(cls):
        import keras

        class _EveryStep(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                self.last = batch

        return _EveryStep()


def jitted_step(model):
    """Keras's own jitted train step (the one fit dispatches), from its closure."""
    model.make_train_function()
    for cell in model.train_function.__closure__ or ():
        fn = cell.cell_contents
        if hasattr(fn, "lower"):
            return fn
    raise RuntimeError("Keras's jitted train step not found")


def fresh_state(model):
    import jax

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    return jax.tree.map(lambda a: a.copy(), state)  # the step donates its state


def hand_loop(model, x, y, batch, steps):
    import jax

    step = jitted_step(model)
    state = fresh_state(model)
    data = jax.device_put((x[:batch], y[:batch]))
    for _ in range(3):
        _, state = step(state, data)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        logs, state = step(state, data)
    jax.block_until_ready(state)
    loop_ms = 1e3 * (time.perf_counter() - start) / steps
    hosts = []
    for _ in range(10):
        jax.block_until_ready(state)
        t = time.perf_counter()
        logs, state = step(state, data)
        hosts.append(time.perf_counter() - t)
    jax.block_until_ready(state)
    n_arrays = len(jax.tree.leaves(state))
    return loop_ms, 1e3 * statistics.median(hosts), n_arrays, (step, state, data)


def iterator_ms(x, y, batch):
    import jax
    from keras.src.backend.jax.trainer import JAXEpochIterator

    it = JAXEpochIterator(x=x, y=y, batch_size=batch, shuffle=False)
    last = None
    for _ in range(2):
        start = time.perf_counter()
        n = 0
        for _, _, iterator in it:
            last = next(iterator)
            n += 1
        jax.block_until_ready(last)
        seconds = time.perf_counter() - start
    return 1e3 * seconds / n


def device_busy_ms(loop, steps):
    """GPU busy ms per step (union of kernel intervals) in a jax.profiler trace."""
    import jax

    step, state, data = loop
    folder = tempfile.mkdtemp(prefix="kmgpu-trace-")
    jax.block_until_ready(state)
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            _, state = step(state, data)
        jax.block_until_ready(state)
    files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(files[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in names.items() if "GPU" in n or "gpu" in n}
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("pid") in gpu)
    if not spans:
        return None
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / 1e3 / steps


def profile(w, batch, variants, log):
    row = {"workload": w.name, "batch": batch}
    x, y = w.data(batch)
    x, y = x[: w.steps * batch], y[: w.steps * batch]
    model = w.build()
    model.compile(**w.compile_args())
    row["fit"] = timed_fit(model, x, y, batch, w.epochs)
    log(f"  {w.name} B={batch} fit {row['fit']:.2f} ms/step")
    if "sync" in variants:
        row["sync"] = timed_fit(model, x, y, batch, w.epochs, extra=[EveryStep()])
    if "iter" in variants:
        row["iter"] = iterator_ms(x, y, batch)
    if "loop" in variants or "trace" in variants:
        row["loop"], row["dispatch"], row["arrays"], loop = hand_loop(
            model, x, y, batch, w.steps)
        if "trace" in variants:
            try:
                row["device"] = device_busy_ms(loop, min(w.steps, 10))
            except Exception as e:  # no CUPTI: the rest of the row stands
                log(f"  trace failed: {type(e).__name__}: {e}")
        del loop
    if "spe8" in variants:
        other = w.build()
        other.compile(**w.compile_args(), steps_per_execution=8)
        row["spe8"] = timed_fit(other, x, y, batch, w.epochs)
    log("  " + json.dumps({k: v for k, v in row.items() if not k.endswith("_mode")},
                          default=str))
    return row


COLUMNS = [("fit", "fit"), ("sync", "sync"), ("iter", "iter"), ("loop", "loop"),
           ("dispatch", "dispatch"), ("device", "device"), ("spe8", "spe8")]


def table(rows):
    cols = [(k, t) for k, t in COLUMNS if any(k in r for r in rows)]
    lines = ["| workload | B | state arrays | " + " | ".join(t + " ms" for _, t in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else "-" for k, _ in cols]
        lines.append(f"| {r['workload']} | {r['batch']} | {r.get('arrays', '-')} | "
                     + " | ".join(cells) + " |")
    lines += ["", "samples/s and the strong-scaling ceiling t(B)/t(B/2) (= 2 x sps(B/2) / "
              "sps(B)):", "",
              "| workload | variant | sps at B | sps at B/2 | B/2 : B | ceiling |",
              "|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault(r["workload"], []).append(r)
    for name, (big, small) in ((n, sorted(rs, key=lambda r: -r["batch"])[:2])
                               for n, rs in by.items() if len(rs) >= 2):
        for key in ("fit", "spe8"):
            if key in big and key in small:
                a, b = 1e3 * big["batch"] / big[key], 1e3 * small["batch"] / small[key]
                lines.append(f"| {name} | {key} | {a:,.0f} | {b:,.0f} | {b / a:.2f} | "
                             f"{2 * b / a:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU sizes")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--variants", default="fit,sync,iter,loop,trace,spe8")
    p.add_argument("--steps", type=int, default=0, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--cache", default="", help="JAX persistent compilation cache folder")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import jax

    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import keras

    variants = set(args.variants.split(","))
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"keras {keras.__version__}, jax {jax.__version__}, {jax.devices()[0].device_kind}")
    rows = []
    for name in args.workloads.split(","):
        w = workload(name, args.quick, args.steps, args.epochs)
        for batch in (w.batch, w.batch // 2):
            started = time.perf_counter()
            rows.append(profile(w, batch, variants, log))
            log(f"  ({time.perf_counter() - started:.0f} s)")
        if args.out:  # what is measured so far survives a time-out
            with open(args.out, "w") as f:
                f.write(table(rows) + "\n")
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()

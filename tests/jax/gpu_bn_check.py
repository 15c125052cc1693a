"""Local vs synchronised BatchNorm on 2 GPUs, JAX: ResNet-50 at 64x64.

A standalone script (not a pytest file). On a machine with 2 GPUs:

    KERAS_BACKEND=jax .venv/bin/python tests/jax/gpu_bn_check.py --runs plain,local,sync,dp
    KERAS_BACKEND=jax .venv/bin/python tests/jax/gpu_bn_check.py \
        --runs plain,plain-device,local,local-device,sync,dp --collectives

(each run is one process of about a minute, most of it ResNet-50's XLA compile;
``--collectives`` adds a compile to each 2-GPU run: split the runs over two commands
where a command may last at most 10 minutes). ``KMGPU_GPU_CHECK_SMOKE=1`` runs the
plumbing on 2 simulated CPU devices with a small model instead.

Each run is its own Python process (a fresh JAX, nothing left on the GPUs), one after
the other: ``keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3),
classes=10)``, global batch 256, random data, 3 epochs of 20 steps, SGD; the figure
is the median epoch after the first (the first holds the XLA compile).

Runs (``--runs``, comma-separated):
    plain          model.fit on one GPU
    plain-device   the same, the 20 batches already on GPU 0 (a generator of jax arrays)
    local          kmgpu.parallelize(model, gpus=2)  (sync_batchnorm=False: local BN)
    local-device   the same, the 20 batches already sharded over both GPUs
    sync           kmgpu.parallelize(model, gpus=2, sync_batchnorm=True)
    dp             keras.distribution.DataParallel on 2 GPUs + fit (the Keras guide)

``--collectives`` also compiles each 2-GPU run's train step once more and counts its
cross-device collectives: how many there are, and whether the moving statistics'
replica mean (op name kmgpu_replica_mean) shares an all-reduce with the gradients.
"""

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = ("plain", "plain-device", "local", "local-device", "sync", "dp")
BATCH, STEPS, EPOCHS, SIZE = 256, 20, 3, 64
COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--collectives", action="store_true",
                   help="count the collectives in each 2-GPU run's compiled train step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.collectives)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    env = dict(os.environ, KERAS_BACKEND="jax")
    for key in ("XLA_FLAGS", "JAX_PLATFORMS", "KMGPU_SIMULATE_DEVICES"):
        env.pop(key, None)  # real GPUs, not simulated CPU devices
    results = []
    for run in runs:
        start = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", run]
        if args.collectives:
            cmd.append("--collectives")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            tail = (proc.stdout + proc.stderr)[-2500:]
            print(f"{run}: failed (exit {proc.returncode})\n{tail}", flush=True)
            results.append({"run": run, "error": f"exit {proc.returncode}"})
            continue
        result = json.loads(line[-1][len("RESULT "):])
        result["process_s"] = time.perf_counter() - start
        results.append(result)
        print(f"{run}: {result['samples_per_s']:,.0f} samples/s "
              f"(epochs {', '.join(f'{s:.2f}' for s in result['epoch_seconds'])} s)", flush=True)
    table(results)
    return 0 if all("error" not in r for r in results) else 1


def table(results):
    ok = {r["run"]: r for r in results if "error" not in r}
    plain = ok.get("plain", {}).get("samples_per_s")
    dp = ok.get("dp", {}).get("samples_per_s")
    print(f"\nResNet-50 {SIZE}x{SIZE}, global batch {BATCH}, {EPOCHS} epochs x {STEPS} steps, "
          "median epoch after the first")
    head = (f"| {'run':<13} | GPUs | samples/s | vs plain 1 GPU | vs DataParallel | "
            f"first epoch s | XLA compile s (train steps) | loss | collectives in the step |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in results:
        if "error" in r:
            print(f"| {r['run']:<13} | failed: {r['error']} |")
            continue
        sps = r["samples_per_s"]
        rel = f"{sps / plain:.2f}x" if plain else "-"
        rdp = f"{sps / dp:.2f}x" if dp else "-"
        coll = r.get("collectives")
        coll = (f"{coll['count']}: {coll['moments']} on BN moments, "
                f"{coll['replica_mean_with_gradients']} replica mean + gradients, "
                f"{coll['replica_mean_alone']} replica mean alone; program "
                f"{coll['program_sha']}" if coll else "-")
        print(f"| {r['run']:<13} | {r['gpus']:>4} | {sps:>9,.0f} | {rel:>14} | {rdp:>15} | "
              f"{r['epoch_seconds'][0]:>13.1f} | "
              f"{r['compile_s']:>19.1f} ({r['train_step_compiles']}) | {r['loss']:.3f} | {coll} |")
    for r in results:
        if r.get("batchnorm"):
            print(f"{r['run']}: describe() BatchNorm: {r['batchnorm']}")


# -- one run, in its own process ------------------------------------------------------
def worker(run, collectives):
    sys.path.insert(0, ROOT)
    smoke = os.environ.get("KMGPU_GPU_CHECK_SMOKE") == "1"  # the plumbing, on 2 CPU devices
    if smoke:
        import kmgpu

        kmgpu.simulate_devices(2)
    import jax
    import keras
    import numpy as np

    gpus = 1 if run.startswith("plain") else 2
    if len(jax.devices()) < gpus or (jax.devices()[0].platform != "gpu" and not smoke):
        raise SystemExit(f"needs {gpus} GPU(s); JAX sees {jax.devices()}")
    batch, size = (8, 16) if smoke else (BATCH, SIZE)
    compiles = []  # XLA compilations in this process: (function, seconds)

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((str(kwargs.get("fun_name", "")), duration))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(batch * STEPS, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch * STEPS,)).astype("int32")

    def build():
        keras.utils.set_random_seed(1)
        if smoke:
            inputs = keras.Input((size, size, 3))
            h = keras.layers.Conv2D(4, 3)(inputs)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.GlobalAveragePooling2D()(h)
            return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))
        return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                           classes=10)

    def compile_args():  # the optimizer's variables live where it is made: inside a scope
        return dict(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    def on_device(sharding):
        """A generator of the 20 batches, placed once; steps_per_epoch=20 for fit."""
        where = None if sharding == "default" else sharding
        batches = [(jax.device_put(x[i * batch:(i + 1) * batch], where),
                    jax.device_put(y[i * batch:(i + 1) * batch], where))
                   for i in range(STEPS)]
        jax.block_until_ready(batches)

        def generate():
            while True:
                yield from batches

        return generate()

    def fit(fit_fn, device_sharding=None):
        timer = Timer()
        if device_sharding is None:
            history = fit_fn(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0,
                             callbacks=[timer])
        else:
            history = fit_fn(on_device(device_sharding), steps_per_epoch=STEPS, epochs=EPOCHS,
                             verbose=0, callbacks=[timer])
        return timer.seconds, float(history.history["loss"][-1])

    from jax.sharding import NamedSharding, PartitionSpec

    result = {"run": run, "gpus": gpus}
    if run.startswith("plain"):
        model = build()
        model.compile(**compile_args())
        # device_put without a device: uncommitted arrays on GPU 0 (committed ones make
        # Keras's plain step compile again when the variables' placement changes)
        seconds, loss = fit(model.fit, "default" if run == "plain-device" else None)
        trained, distribution = None, None
    elif run == "dp":
        distribution = keras.distribution.DataParallel(devices=jax.devices()[:2])
        with distribution.scope():
            model = build()
            model.compile(**compile_args())
            seconds, loss = fit(model.fit)
        trained = model
    else:
        import warnings

        import kmgpu

        model = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel = kmgpu.parallelize(model, gpus=2, sync_batchnorm=(run == "sync"))
        parallel.compile(**compile_args())
        engine = parallel._engine
        distribution = engine.distribution
        mesh = distribution.device_mesh.backend_mesh
        sharding = NamedSharding(mesh, PartitionSpec(distribution.batch_dim_name))
        seconds, loss = fit(parallel.fit, sharding if run == "local-device" else None)
        result["batchnorm"] = engine.batchnorm_mode()
        trained = engine.replica
    steps = [c for name, c in compiles if "train_step" in name]
    result.update(compile_s=sum(c for _, c in compiles), train_step_compiles=len(steps),
                  epoch_seconds=seconds, loss=loss,
                  samples_per_s=batch * STEPS / statistics.median(seconds[1:]))
    if collectives and trained is not None:
        with distribution.scope():
            result["collectives"] = count_collectives(trained, distribution, x[:batch],
                                                      y[:batch])
    return result


def count_collectives(model, distribution, x, y):
    """Collectives in ``model``'s compiled train step on the distribution's mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(distribution.device_mesh.backend_mesh,
                             PartitionSpec(distribution.batch_dim_name))
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    data = (jax.device_put(x, sharding), jax.device_put(y, sharding))
    text = jax.jit(model.train_step).lower(state, data).compile().as_text()
    names = []
    for line in text.splitlines():
        if COLLECTIVE.search(line):
            found = re.search(r'op_name="([^"]*)"', line)
            names.append(found.group(1) if found else "?")
    mean = [n for n in names if "kmgpu_replica_mean" in n]
    program = re.sub(r", metadata=\{[^}]*\}", "", text)  # kmgpu sync vs dp: the same program?
    return {"count": len(names), "program_sha": hashlib.sha1(program.encode()).hexdigest()[:10],
            "replica_mean_with_gradients": sum("transpose(" in n for n in mean),
            "replica_mean_alone": sum("transpose(" not in n for n in mean),
            "moments": sum("batch_normalization" in n and "jit(_var)" in n for n in names)}


if __name__ == "__main__":
    sys.exit(main())

"""``shard=`` (ZeRO-1/2/3): what each shard value saves per device and what it costs.

``KERAS_BACKEND=jax python benchmarks/memory.py [--speed] [--optimizers]`` and
``KERAS_BACKEND=torch python benchmarks/memory.py [--speed]`` on CPU with 8 simulated
devices (torch: one gloo rank per device). With ``--gpus`` the machine's own GPUs instead,
N up to their count (torch: one NCCL rank per GPU): the multi-GPU figures, e.g.
``KERAS_BACKEND=torch python benchmarks/memory.py --gpus --speed --width 4096 --depth 8``.
On torch each row then has the fullest GPU's peak allocated memory beside the arrays'
bytes (``torch.cuda.max_memory_allocated`` of each rank, whose process ends with its
row; on one GPU this process's, reset before the row): weights, gradients, optimizer
state, the step's temporaries and activations together. JAX has no such column: its
devices' peak cannot be reset between the rows of one process.

1. Memory. For N = 1, 2, 4, 8 devices and each ``shard`` value (None, "optimizer",
   "gradients", "weights"; a no-op on one device), a model of Dense layers whose sizes 8
   divides is fitted one step with Adam in float32, and the bytes each device holds are
   MEASURED FROM THE ARRAYS:

   - JAX: each device's addressable shards of every live array of the replica
     (``engine.replica``'s weights and optimizer variables), plus what the user's own
     model holds on each device other than the host CPU device (``engines/jax/host.py``:
     with ``shard=`` its whole state lives in host memory). The gradients live only
     inside the jitted step: they are counted from the sharded layout
     (``zero.planned_bytes`` of the trainable variables: 1/N each under "gradients" /
     "weights", whole otherwise), not measured.
   - torch: each rank's tensors as its train step holds them after the fit (the engine's
     ``rank_held_bytes()``, a ``WeightsQuery("held")`` per rank: flat weights / pieces,
     gradient buffers / pieces, optimizer state / pieces, each storage once). Both runs
     use kmgpu's split step (``jit_compile=True``), so only the sharding differs. On one
     device (no ranks) the user's model's tensors are counted, gradients = trainable.

   On CPU the host device is device 0 itself, so "your model off the host" reads 0 by
   construction; on GPUs the user's model keeps its whole state in host memory only
   where ``shard=`` moves it there (JAX: any shard value; torch: "gradients" / "weights"),
   else on device 0 (+12 B/param there: shard=None, and torch "optimizer").

   Divided by the parameter count they give the bytes per parameter on each device;
   device 0 is its own column, and b(N) is the fullest device's (device 0 included).
   The largest model that fits one H200 is ``P_max = M / b(N)``, M = 141e9 bytes. The
   ideal is b(N) = 16 (None), 8 + 8/N ("optimizer"), 4 + 12/N ("gradients"), 16/N
   ("weights"). Left out of b(N), so the real limit is lower: activations (they grow
   with the batch and the depth, and often dominate), the step's temporaries (with
   "weights" each layer's gathered weights and its whole gradient while it is
   computed; XLA's fusion buffers), the framework's own reservation.

2. ``--optimizers`` (JAX): every Keras optimizer (and EMA, gradient accumulation,
   ``train_on_batch``) on a tiny model, sharded on 4 devices against plain Keras on one:
   the largest relative difference of the weights and of the optimizer variables after 2
   epochs, and how many optimizer variables are sharded.

3. ``--speed``: the step time of each shard value against the unsharded fit on 4
   devices (``--gpus``: as many as there are, at most 8), order-balanced in one process
   (each round runs None and every shard value, the order reversed every other round,
   each after its own compile), median epoch time of each.

Prints tables; no number here is asserted by a test (``tests/jax/test_zero.py`` and
``tests/torch/test_shard_memory.py`` assert the bytes per device on tiny models).
"""

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H200 = 141e9  # bytes
SHARDS = (None, "optimizer", "gradients", "weights")
IDEAL = {None: lambda n: 16.0, "optimizer": lambda n: 8 + 8 / n,
         "gradients": lambda n: 4 + 12 / n, "weights": lambda n: 16 / n}
KINDS = ("weights", "gradients", "optimizer")


def _model(width, depth, features=16):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    return keras.Sequential(layers + [keras.layers.Dense(8)])


def _torch():
    import keras

    return keras.backend.backend() == "torch"


def _parallel(n, shard, width, depth):
    import kmgpu

    model = _model(width, depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one device; few steps
        parallel = kmgpu.parallelize(model, gpus=n, shard=shard)
    # torch: the split step in every run (jit_compile=True), so only the sharding differs
    parallel.compile(optimizer="adam", loss="mse", **({"jit_compile": True} if _torch() else {}))
    return model, parallel


def _data(rows):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, 16)).astype("float32"),
            rng.normal(size=(rows, 8)).astype("float32"))


def _on_devices(variables):
    sizes = {}
    for v in variables:
        for s in v.value.addressable_shards:
            sizes[s.device] = sizes.get(s.device, 0) + s.data.nbytes
    return sizes


def _held_jax(n, shard, model, parallel):
    """{kind: [bytes on device 0, 1, ...]} and the user's model's bytes off the host."""
    import jax

    from kmgpu.engines import replication
    from kmgpu.engines.jax import host, zero

    live = getattr(parallel._engine, "replica", None) or model
    devices = jax.devices()[:n]
    held = {}
    for kind, variables in (("weights", replication.weights(live)),
                            ("optimizer", replication.optimizer_state(live.optimizer))):
        on = _on_devices(variables)
        held[kind] = [on.get(d, 0) for d in devices]
    # the gradients: only inside the jitted step; their planned layout
    per = zero.planned_bytes(live.trainable_variables, n)[0] if (
        n > 1 and shard in ("gradients", "weights")) else sum(
        v.value.nbytes for v in live.trainable_variables)
    held["gradients"] = [per] * n
    mine = _on_devices(host.template_variables(model))
    off_host = sum(b for d, b in mine.items() if d != host.device())
    return held, off_host


def _held_torch(n, shard, model, parallel):
    def size(vs):
        return sum(v.value.numel() * v.value.element_size() for v in vs)

    ranks = parallel._engine.rank_held_bytes() if n > 1 else [None]
    if ranks[0] is None or "weights" not in ranks[0]:
        # one device (no ranks: the user's model itself), or shard=None: the unsharded step
        # keeps no split step to ask (``held_bytes`` is None), so each rank's replica
        # weights are read back (``rank_weights``) and the gradients and the optimizer
        # state are the whole values, as every rank holds them
        weights = ([sum(a.nbytes for a in w) for w in parallel._engine.rank_weights()]
                   if n > 1 else [size(model.weights)])
        held = {"weights": weights, "gradients": [size(model.trainable_weights)] * n,
                "optimizer": [size(model.optimizer.variables)] * n}
    else:
        held = {k: [r[k] for r in ranks] for k in KINDS}
    off_host = 0
    for v in list(model.weights) + list(model.optimizer.variables):
        if v.value.device.type != "cpu":
            off_host += v.value.numel() * v.value.element_size()
    held["peak"] = [(r or {}).get("device_peak") for r in ranks]  # (on a GPU)
    return held, off_host


def counts(gpus):
    """The device counts to measure: 1, 2, 4, 8, or (``gpus``) those the GPUs allow."""
    if not gpus:
        return (1, 2, 4, 8)
    if _torch():
        import torch

        have = torch.cuda.device_count()
    else:
        import jax

        have = len([d for d in jax.devices() if d.platform == "gpu"])
    if not have:
        raise SystemExit("--gpus: this machine has no GPU (run without --gpus: simulated "
                         "CPU devices)")
    return tuple(n for n in (1, 2, 4, 8) if n <= have)


def memory(width, depth, gpus):
    import numpy as np

    x, y = _data(64)
    rows = []
    for n in counts(gpus):
        for shard in SHARDS:
            one_gpu = gpus and _torch() and n == 1  # no ranks: this process's own peak
            if one_gpu:
                import torch

                if torch.cuda.is_initialized():  # (before, there is no peak to reset)
                    torch.cuda.reset_peak_memory_stats(0)
            model, parallel = _parallel(n, shard, width, depth)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                parallel.fit(x, y, batch_size=64, epochs=1, verbose=0)
            params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
            held, off_host = (_held_torch if _torch() else _held_jax)(n, shard, model, parallel)
            totals = [sum(held[k][d] for k in KINDS) / params for d in range(n)]
            other = max(totals[1:], default=None)  # the fullest device but device 0
            peaks = [p for p in held.get("peak", ()) if p is not None]
            if one_gpu:
                peaks = [torch.cuda.max_memory_allocated(0)]
            rows.append((n, shard, params, {k: held[k][0] / params for k in KINDS},
                         totals[0], other, max(totals), off_host / params,
                         max(peaks) if peaks else None))
            parallel.close()  # (torch: the ranks' processes end, so each run's peak is its own)
            del model, parallel  # (one device: this process's peak, this run's model alone)
            gc.collect()
    backend = "torch, each rank's held tensors" if _torch() else (
        "JAX, the arrays' addressable shards on each device")
    print(f"Adam, float32; measured ({backend}) on a {depth} x Dense({width}) model "
          f"({rows[0][2]:,} parameters), {'GPUs' if gpus else 'simulated CPU devices'}. "
          "B/param = bytes per "
          "parameter; dev 0 = device 0; b(N) = the fullest device's (device 0 included); "
          "P_max = 141e9 B / b(N), activations not counted\n")
    print("| N | shard | weights dev 0 | gradients dev 0 | optimizer dev 0 | total dev 0 "
          "| total, fullest other device | b(N) | ideal b(N) | your model off the host "
          "| P_max (billion params) | peak allocated, fullest device (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, shard, _, k, t0, other, b, off, peak in rows:
        print(f"| {n} | {shard} | {k['weights']:.3f} | {k['gradients']:.3f} | "
              f"{k['optimizer']:.3f} | {t0:.3f} | {'-' if other is None else f'{other:.3f}'} | "
              f"{b:.3f} | {IDEAL[shard](n):.3f} | {off:.3f} | {H200 / b / 1e9:.2f} | "
              f"{'-' if peak is None else f'{peak / 1e6:.1f}'} |")
    print("\nP_max, billion parameters (Adam, float32, activations not counted):\n")
    print("| shard | N=1 | N=2 | N=4 | N=8 |")
    print("|---|---|---|---|---|")
    for shard in SHARDS:
        cells = [f"{H200 / r[6] / 1e9:.2f}" for r in rows if r[1] == shard]
        print(f"| {shard} | " + " | ".join(cells) + " |")


def optimizers():
    import keras
    import numpy as np

    import kmgpu
    from tests.helpers import rel_diff

    def tiny():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])

    def state(model):
        return [np.asarray(v) for v in model.optimizer.variables]

    o = keras.optimizers
    cases = {
        "SGD(momentum=0.9)": lambda: o.SGD(0.05, momentum=0.9), "Adam": lambda: o.Adam(0.02),
        "AdamW": lambda: o.AdamW(0.02), "Adamax": lambda: o.Adamax(0.02),
        "Nadam": lambda: o.Nadam(0.02), "RMSprop": lambda: o.RMSprop(0.01),
        "Adagrad": lambda: o.Adagrad(0.05), "Adadelta": lambda: o.Adadelta(1.0),
        "Ftrl": lambda: o.Ftrl(0.05), "Lion": lambda: o.Lion(0.005),
        "Adafactor (factored)": lambda: o.Adafactor(0.05),
        "Lamb (per-layer trust ratio)": lambda: o.Lamb(0.02),
        "Muon (orthogonalised 2-D updates)": lambda: o.Muon(0.02),
        "Adam(use_ema=True)": lambda: o.Adam(0.02, use_ema=True, ema_overwrite_frequency=3),
        "Adam(gradient_accumulation_steps=2)": lambda: o.Adam(0.02, gradient_accumulation_steps=2),
    }
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 5)).astype("float32"), rng.normal(size=(70, 1)).astype("float32")
    print("\nEvery Keras optimizer, 4 simulated devices, shard='optimizer' against plain Keras "
          "on one device, 2 epochs (70 rows, batch 16)\n")
    print("| optimizer | weights rel. diff | optimizer variables rel. diff | sharded variables |")
    print("|---|---|---|---|")
    for name, make in cases.items():
        ref = tiny()
        ref.compile(optimizer=make(), loss="mse")
        ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model = tiny()
        parallel = kmgpu.parallelize(model, gpus=4, shard="optimizer")
        parallel.compile(optimizer=make(), loss="mse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        replica = parallel._engine.replica.optimizer.variables
        sharded = sum(not v.value.sharding.is_fully_replicated for v in replica)
        print(f"| {name} | {rel_diff(ref.get_weights(), model.get_weights()):.1e} | "
              f"{rel_diff(state(ref), state(model)):.1e} | {sharded} of {len(replica)} |")
        parallel.close()
    ref, model = tiny(), tiny()
    parallel = kmgpu.parallelize(model, gpus=4, shard="optimizer")
    for m in (ref, parallel):
        m.compile(optimizer="adam", loss="mse")
    for i in range(3):
        ref.train_on_batch(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16])
        parallel.train_on_batch(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16])
    print(f"| Adam, 3 x train_on_batch | {rel_diff(ref.get_weights(), model.get_weights()):.1e} "
          f"| {rel_diff(state(ref), state(model)):.1e} | |")


def speed(width, depth, rounds, steps, gpus):
    import numpy as np

    n = counts(gpus)[-1] if gpus else 4
    x, y = _data(64 * steps)
    runs = {shard: _parallel(n, shard, width, depth)[1] for shard in SHARDS}
    times = {shard: [] for shard in SHARDS}

    def epoch(shard):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[shard].fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    for shard in SHARDS:
        epoch(shard)  # compile
    for r in range(rounds):
        for shard in (SHARDS if r % 2 == 0 else SHARDS[::-1]):
            times[shard].append(epoch(shard))
    params = sum(int(np.prod(v.shape)) for v in runs[None].model.trainable_variables)
    for run in runs.values():
        run.close()
    base = statistics.median(times[None])
    where = f"{n} GPUs" if gpus else f"{n} simulated CPU devices"
    print(f"\n{where}, {depth} x Dense({width}) ({params:,} parameters), Adam, "
          f"batch 64, {steps} steps per fit, {rounds} rounds alternating the order\n")
    print("| shard | median ms/step | / shard=None | all ms/step |")
    print("|---|---|---|---|")
    for shard in SHARDS:
        m = statistics.median(times[shard])
        print(f"| {shard} | {1e3 * m:.2f} | {m / base:.3f}x | "
              f"{', '.join(f'{1e3 * t:.1f}' for t in times[shard])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--speed", action="store_true", help="also time the step")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument("--optimizers", action="store_true",
                        help="also check every Keras optimizer against one device (JAX)")
    parser.add_argument("--gpus", action="store_true",
                        help="this machine's GPUs, not simulated CPU devices")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import kmgpu

    if not args.gpus:
        kmgpu.simulate_devices(8)
    if not args.no_memory:
        memory(args.width, args.depth, args.gpus)
    if args.optimizers and not _torch():
        optimizers()
    if args.speed:
        speed(args.width, args.depth, args.rounds, args.steps, args.gpus)


if __name__ == "__main__":
    main()

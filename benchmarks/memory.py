"""``shard_optimizer=True`` (ZeRO stage 1): what it saves and what it costs.

``KERAS_BACKEND=jax python benchmarks/memory.py [--speed]`` on CPU with 8 simulated devices;
``KERAS_BACKEND=torch python benchmarks/memory.py [--speed]``: torch (``engines/torch/optim/zero.py``),
where 1. is the bytes of each rank's pieces from the layout ``zero.Shards`` makes (every
variable 256-byte aligned, each dtype padded to N equal pieces; ``tests/torch/test_zero.py``
asserts a rank's tensors are that), without starting the ranks, and 3. compares two
split steps (``jit_compile=True``: the unsharded one all-reduces and updates with
``flat_optim``), so only the sharding differs.

1. Memory. For N = 1, 2, 4, 8 devices, with and without sharding, a model of Dense
   layers whose sizes 8 divides is fitted one step with Adam in float32, and the bytes
   each device holds are read from the arrays' addressable shards (the replica's
   weights and optimizer state; the gradients are whole on every device during the
   step, as many bytes as the trainable weights). Divided by the parameter count they
   give the bytes per parameter per device, b(N), and the largest model that fits one
   H200 is ``P_max = M / b(N)`` with M = 141e9 bytes (the H200's 141 GB), i.e.

       b(N) = 4 (weights) + 4 (gradients) + 8 / N (Adam's m and v; 8 unsharded)

   Left out of b(N), so the real limit is lower: activations (which grow with the batch
   and the depth, and often dominate), XLA's temporaries in the step (the updated
   weights before they are gathered, fusion buffers), the step counter and variables
   no dimension of which N divides (kept whole; ~0 here), the framework's own
   reservation (XLA preallocates 75% of the GPU by default). The user's own model keeps a
   whole copy of the weights and the optimizer state on its device (device 0) between
   calls (kmgpu copies the state back after every fit): the last two columns count it,
   measured the same way, b0(N) = b(N) + 4 + 8 on device 0, which then sets the limit.

2. ``--optimizers``: every Keras optimizer (and EMA, gradient accumulation,
   ``train_on_batch``) on a tiny model, sharded on 4 devices against plain Keras on one:
   the largest relative difference of the weights and of the optimizer variables after 2
   epochs, and how many optimizer variables are sharded.

3. ``--speed``: the step time of the sharded and the unsharded fit on 4 simulated
   devices, order-balanced in one process (unsharded, sharded, unsharded, sharded...,
   each after its own compile), median epoch time of each.

Prints tables; no number here is asserted by a test (``tests/jax/test_zero.py`` asserts
the bytes per device on a tiny model).
"""

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H200 = 141e9  # bytes


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
        parallel = kmgpu.parallelize(model, gpus=n, shard_optimizer=shard)
    # torch: the split step in both runs (jit_compile=True), so only the sharding differs
    parallel.compile(optimizer="adam", loss="mse", **({"jit_compile": True} if _torch() else {}))
    return model, parallel


def memory_torch(width, depth):
    """torch: bytes per parameter per rank from the layout of ``zero.Shards``."""
    import keras

    from kmgpu.engines.torch.optim import flat_layout, zero

    model = _model(width, depth)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.optimizer.build(model.trainable_variables)
    params = sum(v.value.numel() for v in model.trainable_variables)
    w = sum(v.value.numel() * v.value.element_size() for v in model.weights) / params
    print(f"Adam, float32, torch; layout of a {depth} x Dense({width}) model ({params:,} "
          "parameters); largest model on one H200 = 141e9 B / (bytes per parameter per device)\n")
    print("| devices | sharded | weights B/param | gradients B/param | optimizer B/param "
          "| total B/param/device | largest model (billion params) |")
    print("|---|---|---|---|---|---|---|")
    for n in (1, 2, 4, 8):
        per, whole, _ = zero.state_bytes(model, n)
        for shard in ((False,) if n == 1 else (False, True)):
            # the gradient buffer: padded to N aligned pieces when sharded
            grads = flat_layout.offsets([v.value for v in model.trainable_variables],
                                        n if shard else 1)[1] * 4
            o = (per if shard else whole) / params
            b = w + grads / params + o
            print(f"| {n} | {'yes' if shard else ('no' if n > 1 else '-')} | {w:.3f} | "
                  f"{grads / params:.3f} | {o:.3f} | {b:.3f} | {H200 / b / 1e9:.2f} |")


def _on_devices(variables):
    sizes = {}
    for v in variables:
        for s in v.value.addressable_shards:
            sizes[s.device] = sizes.get(s.device, 0) + s.data.nbytes
    return sizes


def _per_device(variables):
    return max(_on_devices(variables).values())


def memory(width, depth):
    import numpy as np

    from kmgpu.engines import replication

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 8)).astype("float32")
    rows = []
    for n in (1, 2, 4, 8):
        for shard in (False, True):
            if n == 1 and shard:
                continue  # a no-op
            model, parallel = _parallel(n, shard, width, depth)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                parallel.fit(x, y, batch_size=64, epochs=1, verbose=0)
            live = parallel._engine.replica if n > 1 else model
            params = sum(int(np.prod(v.shape)) for v in live.trainable_variables)
            w = _per_device(replication.weights(live)) / params
            g = sum(v.value.nbytes for v in live.trainable_variables) / params
            o = _per_device(replication.optimizer_state(live.optimizer)) / params
            b = w + g + o
            # device 0 also holds your own model's weights and optimizer state, whole
            mine = replication.weights(model) + replication.optimizer_state(model.optimizer)
            first = parallel._engine.replica.weights[0].value.addressable_shards[0].device \
                if n > 1 else None
            b0 = b + (_on_devices(mine).get(first, 0) / params if n > 1 else 0)
            rows.append((n, "yes" if shard else ("no" if n > 1 else "-"), w, g, o, b,
                         H200 / b / 1e9, params, b0, H200 / b0 / 1e9))
            parallel.close()
    print(f"Adam, float32; measured on a {depth} x Dense({width}) model "
          f"({rows[0][7]:,} parameters), 8 simulated CPU devices; "
          f"largest model on one H200 = 141e9 B / (bytes per parameter per device)\n")
    print("| devices | sharded | weights B/param | gradients B/param | optimizer B/param "
          "| total B/param/device | largest model (billion params) | device 0 with your "
          "model's copy: B/param | largest model, device 0 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, s, w, g, o, b, pmax, _, b0, pmax0 in rows:
        print(f"| {n} | {s} | {w:.3f} | {g:.3f} | {o:.3f} | {b:.3f} | {pmax:.2f} | {b0:.3f} "
              f"| {pmax0:.2f} |")


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
    print("\nEvery Keras optimizer, 4 simulated devices, shard_optimizer=True against plain Keras "
          "on one device, 2 epochs (70 rows, batch 16)\n")
    print("| optimizer | weights rel. diff | optimizer variables rel. diff | sharded variables |")
    print("|---|---|---|---|")
    for name, make in cases.items():
        ref = tiny()
        ref.compile(optimizer=make(), loss="mse")
        ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model = tiny()
        parallel = kmgpu.parallelize(model, gpus=4, shard_optimizer=True)
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
    parallel = kmgpu.parallelize(model, gpus=4, shard_optimizer=True)
    for m in (ref, parallel):
        m.compile(optimizer="adam", loss="mse")
    for i in range(3):
        ref.train_on_batch(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16])
        parallel.train_on_batch(x[16 * i:16 * i + 16], y[16 * i:16 * i + 16])
    print(f"| Adam, 3 x train_on_batch | {rel_diff(ref.get_weights(), model.get_weights()):.1e} "
          f"| {rel_diff(state(ref), state(model)):.1e} | |")


def speed(width, depth, rounds, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = 64 * steps
    x, y = rng.normal(size=(rows, 16)).astype("float32"), rng.normal(size=(rows, 8)).astype(
        "float32")
    runs = {shard: _parallel(4, shard, width, depth)[1] for shard in (False, True)}
    times = {False: [], True: []}

    def epoch(shard):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[shard].fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    for shard in (False, True):
        epoch(shard)  # compile
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for shard in order:
            times[shard].append(epoch(shard))
    a, b = statistics.median(times[False]), statistics.median(times[True])
    params = sum(int(np.prod(v.shape)) for v in runs[False].model.trainable_variables)
    for run in runs.values():
        run.close()
    print(f"\n4 simulated CPU devices, {depth} x Dense({width}) ({params:,} parameters), Adam, "
          f"batch 64, {steps} steps per fit, {rounds} rounds alternating the order\n")
    print("| run | median ms/step | all ms/step |")
    print("|---|---|---|")
    print(f"| unsharded | {1e3 * a:.2f} | {', '.join(f'{1e3 * t:.1f}' for t in times[False])} |")
    print(f"| shard_optimizer=True | {1e3 * b:.2f} | "
          f"{', '.join(f'{1e3 * t:.1f}' for t in times[True])} |")
    print(f"\nsharded / unsharded: {b / a:.3f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--speed", action="store_true", help="also time the step")
    parser.add_argument("--optimizers", action="store_true",
                        help="also check every Keras optimizer against one device")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import kmgpu

    kmgpu.simulate_devices(8)
    if _torch():
        memory_torch(args.width, args.depth)
    else:
        memory(args.width, args.depth)
    if args.optimizers and not _torch():
        optimizers()
    if args.speed:
        speed(args.width, args.depth, args.rounds, args.steps)


if __name__ == "__main__":
    main()

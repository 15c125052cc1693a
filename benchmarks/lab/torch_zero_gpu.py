"""torch on one GPU: the flat optimizer's speed and the captured sharded steps.

``KERAS_BACKEND=torch python benchmarks/lab/torch_zero_gpu.py [--small] [--out DIR]``

1. Speed: ResNet-50 64x64 (batch 256, Adam), kmgpu's captured step on one GPU with
   Keras's own ``optimizer.apply`` in stage B (``KMGPU_TORCH_FLAT_OPTIMIZER=0``) and with
   kmgpu's flat update (``flat_optim``), order-balanced in one process: off, on, off, on;
   samples/s of the median epoch after the first.
2. The captured sharded steps at N = 1: a 1-rank process group (NCCL on a GPU, gloo on a
   CPU), the split step with each ``shard`` value ("optimizer", "gradients", "weights")
   captured as CUDA graphs (its reduce-scatter / all-reduce and all-gather run between
   the graphs; with "weights" the layers' gathers run inside graph A), against the
   unsharded captured step from the same weights, TF32 off: the relative difference of
   the weights and of the optimizer variables after 2 epochs (Adam: reduce-scatter; AdamW
   with clipnorm: the all-reduce path), and whether both steps were captured.
3. The step time of each ``shard`` value against the unsharded one on the same 1-rank
   group (ResNet-50 64x64, batch 256, Adam; captured), order-balanced.

Prints a markdown table; ``--out`` also writes it there. ``--small``: tiny sizes (a CPU).
"""

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.lab.torch_default import cuda, epoch_timer, exact, rel_diff  # noqa: E402


def speed(image, batch, steps, epochs, order, small=False):
    import keras
    import numpy as np

    import kmgpu

    keras.utils.set_random_seed(0)
    def make():
        if small:  # a CPU smoke run: a small conv net instead
            return keras.Sequential([keras.Input((image, image, 3)),
                                     keras.layers.Conv2D(8, 3), keras.layers.BatchNormalization(),
                                     keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3),
                                           classes=10, classifier_activation=None)

    model = make()
    init = model.get_weights()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, image, image, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * steps).astype("int32")
    rows = []
    for flat in order:
        os.environ["KMGPU_TORCH_FLAT_OPTIMIZER"] = "1" if flat else "0"
        model = make()
        model.set_weights(init)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one device
            parallel = kmgpu.parallelize(model, gpus=1)
        # jit_compile=True: the split step on a CPU too (the GPU's default anyway)
        parallel.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True,
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        timer = epoch_timer()
        parallel.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[timer])
        step = getattr(parallel._engine, "_step", None)
        path = step.split.optimizer_path if step is not None else "?"
        captured = bool(step is not None and step.graphs)
        rate = len(x) / statistics.median(timer.times[1:])
        rows.append((flat, rate, captured, path))
        print(f"flat={flat} {rate:,.0f} samples/s captured={captured} ({path})", flush=True)
        parallel.close()
    os.environ.pop("KMGPU_TORCH_FLAT_OPTIMIZER", None)
    return rows


def _group():
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dist.init_process_group("nccl" if cuda() else "gloo", rank=0, world_size=1)
    return torch.device("cuda:0" if cuda() else "cpu")


SHARDS = (None, "optimizer", "gradients", "weights")


def one_rank(build, make_opt, loss, x, y, shard, epochs, batch):
    """One fit of ``build()`` through the split step on the 1-rank group, captured as CUDA
    graphs on a GPU, TF32 off: (weights, optimizer variables, captured, optimizer path,
    epoch seconds); with shard="weights" the path says how many of the layers' gathers
    were started ahead of their use (prefetched) in all."""
    from kmgpu.engines.torch.capture import graphs

    device = "cuda:0" if cuda() else "cpu"
    model = build()
    model.compile(optimizer=make_opt(), loss=loss)
    split = graphs.SplitStep(model, world=1, rank=0, shard=shard)
    step = graphs.CapturedStep(split, device, tf32=False)
    timer = epoch_timer()
    with exact(), graphs.installed(model, step):
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[timer])
    if split.zero is not None:
        split.zero.materialize()
    captured = bool(step.graphs) and all(e.graph_b is not None for e in step.graphs.values())
    path = split.optimizer_path
    gathering = split.zero.gathering if split.zero is not None else None
    if gathering is not None:  # (a replayed graph runs its gathers without counting them)
        path += (f"; eager and captured steps: {gathering.gathers} layer gathers, "
                 f"{gathering.prefetches} of them started ahead of their use")
    out = (model.get_weights(), [v.numpy() for v in model.optimizer.variables], captured,
           path, timer.times)
    step.close()
    return out


def sharded_parity(n, epochs):
    """Each ``shard`` value against the unsharded split step from the same weights (Adam:
    reduce-scatter; AdamW with clipnorm: the all-reduce path)."""
    import keras
    import numpy as np

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((16, 16, 3)), keras.layers.Conv2D(16, 3, padding="same"),
            keras.layers.BatchNormalization(), keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(37),
            keras.layers.Dense(10)])

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 16, 16, 3), dtype=np.float32)
    y = rng.standard_normal((n, 10), dtype=np.float32)
    cases = {"Adam (reduce-scatter)": lambda: keras.optimizers.Adam(1e-2),
             "AdamW clipnorm (all-reduce)": lambda: keras.optimizers.AdamW(
                 1e-2, weight_decay=0.05, clipnorm=0.5)}
    rows = []
    for name, make_opt in cases.items():
        w0, s0, c0, _, _ = one_rank(build, make_opt, "mse", x, y, None, epochs, 32)
        for shard in SHARDS[1:]:
            w1, s1, c1, path, _ = one_rank(build, make_opt, "mse", x, y, shard, epochs, 32)
            rows.append((name, shard, rel_diff(w0, w1), rel_diff(s0, s1), c0, c1, path))
            print(rows[-1], flush=True)
    return rows


def shard_speed(image, batch, steps, epochs, small):
    """The captured step's median epoch for each ``shard`` value on the 1-rank group,
    order-balanced (None, optimizer, gradients, weights, then back)."""
    import keras
    import numpy as np

    def build():
        keras.utils.set_random_seed(0)
        if small:
            return keras.Sequential([keras.Input((image, image, 3)),
                                     keras.layers.Conv2D(8, 3), keras.layers.BatchNormalization(),
                                     keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3),
                                           classes=10, classifier_activation=None)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, image, image, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * steps).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    times = {s: [] for s in SHARDS}
    captured = {}
    for shard in SHARDS + SHARDS[::-1]:
        _, _, c, _, t = one_rank(build, lambda: keras.optimizers.Adam(1e-3), loss, x, y,
                                 shard, epochs, batch)
        times[shard].append(statistics.median(t[1:]))
        captured[shard] = c
        print(f"shard={shard}: epoch {times[shard][-1]:.3f} s, captured={c}", flush=True)
    base = statistics.mean(times[None])
    return [(s, statistics.mean(times[s]), statistics.mean(times[s]) / base, captured[s],
             times[s]) for s in SHARDS]


def markdown(speed_rows, parity_rows, shard_rows, args):
    lines = [f"# torch on one {'GPU' if cuda() else 'CPU'}: the flat optimizer and the "
             "captured sharded step", "",
             f"`benchmarks/torch_zero_gpu.py{' --small' if args.small else ''}`", "",
             f"## ResNet-50 {args.image}x{args.image}, batch {args.batch}, Adam: captured "
             "step, samples/s (median epoch after the first), order as run", "",
             "| stage B | samples/s | captured | optimizer |", "|---|---|---|---|"]
    for flat, rate, captured, path in speed_rows:
        lines.append(f"| {'flat_optim' if flat else 'Keras apply'} | {rate:,.0f} | "
                     f"{captured} | {path} |")
    for flat in (False, True):
        rates = [r for f, r, _, _ in speed_rows if f == flat]
        if rates:
            lines.append(f"| **mean, {'flat' if flat else 'Keras'}** | "
                         f"**{statistics.mean(rates):,.0f}** | | |")
    lines += ["", "## Each shard value at N = 1 (1-rank group), captured, TF32 off, 2 epochs: "
              "against the unsharded split step", "",
              "| optimizer | shard | weights rel. diff | optimizer vars rel. diff | unsharded "
              "captured | sharded captured | sharded path |", "|---|---|---|---|---|---|---|"]
    for name, shard, dw, ds, c0, c1, path in parity_rows:
        lines.append(f"| {name} | {shard} | {dw:.2e} | {ds:.2e} | {c0} | {c1} | {path} |")
    lines += ["", f"## Step time of each shard value at N = 1 (1-rank group), captured, TF32 "
              f"off: {'a small conv net' if args.small else f'ResNet-50 {args.image}x{args.image}'}, "
              f"batch {args.batch}, Adam; median epoch after the first, each value run twice "
              "(order None, optimizer, gradients, weights, then back)", "",
              "| shard | epoch (s), mean of 2 | vs unsharded | captured | the two runs (s) |",
              "|---|---|---|---|---|"]
    for shard, t, ratio, c, runs in shard_rows:
        lines.append(f"| {shard} | {t:.3f} | {ratio:.2f}x | {c} | "
                     f"{', '.join(f'{r:.3f}' for r in runs)} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.image, args.batch, steps, epochs = ((16, 8, 12, 3) if args.small else (64, 256, 24, 4))
    start = time.perf_counter()
    speed_rows = speed(args.image, args.batch, steps, epochs, (False, True, False, True),
                       args.small)
    _group()
    parity_rows = sharded_parity(64 if args.small else 640, 2)
    shard_rows = shard_speed(args.image, args.batch, steps, epochs, args.small)
    text = markdown(speed_rows, parity_rows, shard_rows, args)
    print(text, f"({time.perf_counter() - start:.0f} s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "torch-zero-gpu.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

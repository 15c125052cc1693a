"""A keras-hub causal LM fine-tuned on one GPU: kmgpu on torch against plain Keras on torch
and on JAX, with and without LoRA. Prints a Markdown table; no test asserts its figures.

    python benchmarks/keras_hub_lm.py [--quick] [--rounds R] [--steps S] [--budget SECONDS]
        [--profile DIR]

The model is a Llama-style ``LlamaCausalLM`` from a random config (no download): 16 layers,
hidden 1024, 16 query heads and 8 key-value heads, MLP 2816, vocabulary 32,000: about 255
million parameters, in Keras's ``mixed_bfloat16`` policy, AdamW, sequences of 256 tokens,
batch 8, the padding mask as sample weights. ``--quick`` shrinks it to run on a CPU.

Every run is a process of its own (``--child``), so no run inherits another's compiled
code or warm caches, and the runs alternate: each round runs every variant, the order
reversed every other round. A run fits 3 epochs of S steps in one call: the first compiles
or captures, its samples/s is the median of the other two; then one more call of one epoch,
whose samples/s (the "one call" column) includes what a `fit` call costs around its steps.
The variants are plain Keras on torch and kmgpu on torch (``parallelize(model, gpus=1)``),
each with and without ``backbone.enable_lora(rank=8)``, and plain Keras on JAX without LoRA.
A kmgpu run whose train step is not captured, or whose capture or replay failed, prints a
kmgpu line that says it runs eagerly (``FALLBACK``), shown with the run's figures; the
table's last column gives, per run, how many of its timed steps (after the first epoch)
replayed a captured graph, and whether such a line came. Runs that would pass ``--budget``
seconds are left out, and the table says which. keras-hub's ``fit`` turns the arrays into a
grain or tf.data dataset, so grain or TensorFlow must be installed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = (("torch", "plain", False), ("torch", "kmgpu", False), ("jax", "plain", False),
            ("torch", "kmgpu", True), ("torch", "plain", True))
#: kmgpu's lines when its train step is not (or no longer) replayed from CUDA graphs: not
#: captured at all, or a capture or replay that failed ("... runs eagerly from here on")
FALLBACK = ("the train step runs eagerly, not captured", "runs eagerly from here on",
            "with the eager step from here on")


def config(quick):
    if quick:
        return dict(vocabulary_size=512, num_layers=2, num_query_heads=4,
                    num_key_value_heads=2, hidden_dim=64, intermediate_dim=128), 32, 4
    return dict(vocabulary_size=32000, num_layers=16, num_query_heads=16,
                num_key_value_heads=8, hidden_dim=1024, intermediate_dim=2816), 256, 8


def lm(quick, lora, steps):
    """The compiled model (seeded, in its precision policy), its data of ``steps`` batches
    and the batch size: (model, (x, y, sample_weight), batch)."""
    import numpy as np

    import keras
    import keras_hub

    keras.mixed_precision.set_global_policy("float32" if quick else "mixed_bfloat16")
    keras.utils.set_random_seed(0)
    cfg, length, batch = config(quick)
    backbone = keras_hub.models.LlamaBackbone(**cfg)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if lora:
        model.backbone.enable_lora(rank=8)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), weighted_metrics=["accuracy"])
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg["vocabulary_size"], size=(batch * steps, length + 1)
                       ).astype("int32")
    mask = np.ones_like(ids, dtype=bool)
    mask[::4, -length // 4:] = False
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return model, (x, ids[:, 1:], mask[:, 1:].astype("float32")), batch


def child(args):
    """One run: build, fit 3 epochs (the first compiles or captures), then one more call
    of one epoch; print JSON."""
    import numpy as np

    import keras

    import kmgpu

    model, (x, y, w), batch = lm(args.quick, args.lora, args.steps)
    rows = batch * args.steps
    fitter = kmgpu.parallelize(model, gpus=1) if args.variant == "kmgpu" else model
    fates = (step_fates() if args.variant == "kmgpu" and keras.backend.backend() == "torch"
             else None)

    class EpochTimes(keras.callbacks.Callback):
        """Wall seconds of each epoch (the epoch's end waits for the device)."""
        seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.began)

    epochs = EpochTimes()
    fitter.fit(x, y, sample_weight=w, batch_size=batch, epochs=3, shuffle=False, verbose=0,
               callbacks=[epochs])
    first = epochs.seconds[0]
    start = time.perf_counter()
    fitter.fit(x, y, sample_weight=w, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    call = time.perf_counter() - start
    timed = [f == "replayed" for k, f, _ in fates or () if k == "train"][args.steps:]
    print("LMRUN " + json.dumps({
        "params": int(model.count_params()),
        "trainable": int(sum(np.prod(v.shape) for v in model.trainable_weights)),
        "samples_per_s": rows / statistics.median(epochs.seconds[1:]),
        "call_samples_per_s": rows / call, "first_epoch_s": first,
        # the timed steps (after the first epoch) that replayed a captured graph
        "replayed": None if fates is None else [sum(timed), len(timed)]}), flush=True)
    if args.profile:  # after the timed calls' line: what it prints is not theirs
        profile(fitter, (x, y, w), batch, args)


def step_fates():
    """kmgpu on torch: a list that gets, for every step kmgpu's captured steps run,
    (kind, fate, graphs dropped): fate "replayed" (its batch signature was captured before
    it and still is after), "captured", or "eager" with kmgpu's reason where that kind of
    step was refused; graphs dropped: a flat buffer was made since the step before."""
    from kmgpu.engines.torch.capture import graphs

    fates = []
    step = graphs.CapturedSteps.step

    def recorded(self, kind, data):
        before, generation = set(self.graphs), self._generation
        out = step(self, kind, data)
        key = self.last.get(kind)
        fate = ("replayed" if key in before and key in self.graphs else
                "captured" if key in self.graphs else
                f"eager ({self.refused[kind]})" if kind in self.refused else "eager")
        fates.append((kind, fate, generation != self._generation))
        return out

    graphs.CapturedSteps.step = recorded
    return fates


def profile(fitter, data, batch, args):
    """torch only: one more epoch under torch.profiler; the top ops by device and by host
    time, and the device's busy share of the wall time, into --profile's folder."""
    import keras

    if keras.backend.backend() != "torch":
        return
    import torch
    from torch.profiler import ProfilerActivity

    x, y, w = data
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    start = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        fitter.fit(x, y, sample_weight=w, batch_size=batch, epochs=1, shuffle=False,
                   verbose=0)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    device = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    name = f"{args.variant}{'-lora' if args.lora else ''}"
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"profile-{name}.txt"), "w") as f:
        f.write(f"# {name}: {args.steps} steps, wall {wall:.2f} s, device busy "
                f"{device:.2f} s (kernels' self time)\n\n")
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            try:
                f.write(events.table(sort_by=key, row_limit=30, max_name_column_width=70))
            except Exception as e:  # no CUDA column on a CPU
                f.write(f"({key}: {e})\n")
            f.write("\n")


def run(backend, variant, lora, args, profile=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant,
           "--steps", str(args.steps)] + (["--lora"] if lora else []) \
        + (["--profile", args.profile] if profile and backend == "torch" else []) \
        + (["--quick"] if args.quick else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, KERAS_BACKEND=backend))
    out = proc.stdout + proc.stderr
    got = [json.loads(line[len("LMRUN "):]) for line in proc.stdout.splitlines()
           if line.startswith("LMRUN ")]
    if proc.returncode or not got:
        print(f"  {backend} {variant} lora={lora}: exit {proc.returncode}\n{out[-3000:]}",
              flush=True)
        return None, time.perf_counter() - start
    timed = proc.stdout.split("LMRUN ")[0]  # what the timed calls printed
    said = [line for line in timed.splitlines() if any(f in line for f in FALLBACK)]
    got[0]["fallback"] = bool(said)
    for line in said:
        print(f"  {backend} {variant} lora={lora}: {line}", flush=True)
    return got[0], time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, for a CPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--budget", type=float, default=520, help="seconds for all runs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="torch runs of round 1: one more epoch under torch.profiler, "
                        "its top ops written to DIR/profile-<variant>.txt")
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    began, results, left_out, longest = time.perf_counter(), {}, [], 0.0
    for r in range(args.rounds):
        for key in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            spent = time.perf_counter() - began
            if spent + longest > args.budget:
                left_out.append(f"round {r + 1} {key[0]} {key[1]}{' LoRA' if key[2] else ''}")
                continue
            got, seconds = run(*key, args, profile=bool(args.profile) and r == 0)
            longest = max(longest, seconds)
            print(f"  round {r + 1} {key}: {got} ({seconds:.0f} s)", flush=True)
            if got:
                results.setdefault(key, []).append(got)
    jax_plain = statistics.median(g["samples_per_s"] for g in results.get(VARIANTS[2], [])
                                  ) if results.get(VARIANTS[2]) else None
    print("\n| backend | fit | LoRA | parameters (trainable) | samples/s (runs) | median "
          "| / Keras-JAX | one call samples/s | first epoch s | kmgpu's timed steps replayed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in VARIANTS:
        got = results.get(key)
        if not got:
            continue
        rates = [g["samples_per_s"] for g in got]
        median = statistics.median(rates)
        ratio = f"{median / jax_plain:.2f}x" if jax_plain else "-"
        captured = "-" if key[1] == "plain" else ", ".join(
            (f"{g['replayed'][0]} of {g['replayed'][1]}" if g.get("replayed") else "?")
            + (" (fallback line)" if g["fallback"] else "") for g in got)
        print(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | "
              f"{got[0]['params'] / 1e6:.1f} M ({got[0]['trainable'] / 1e6:.1f} M) | "
              f"{', '.join(f'{v:,.1f}' for v in rates)} | {median:,.1f} | {ratio} | "
              f"{statistics.median(g['call_samples_per_s'] for g in got):,.1f} | "
              f"{statistics.median(g['first_epoch_s'] for g in got):.0f} | {captured} |")
    if left_out:
        print(f"\nLeft out to stay within --budget {args.budget:.0f} s: " + "; ".join(left_out))


if __name__ == "__main__":
    main()

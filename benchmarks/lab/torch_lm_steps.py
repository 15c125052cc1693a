"""Which train steps of a keras-hub causal LM under kmgpu on torch replay a CUDA graph, and
where the host time of a ``fit`` call goes. A probe that prints, not a test.

    KERAS_BACKEND=torch python benchmarks/lab/torch_lm_steps.py [--quick] [--lora]
        [--steps 12]

The model, data and compile are ``benchmarks/keras_hub_lm.py``'s (a 254 M-parameter
``LlamaCausalLM`` from a random config, bf16, AdamW; ``--quick``: its tiny stand-in).
``parallelize(model, gpus=1)`` fits 2 epochs of ``--steps`` steps, then one more
one-epoch call under cProfile. Per call it prints how many train steps were replayed from a
captured graph, captured, or run eagerly (warm-up or refused), and whether the graphs were
dropped (a flat buffer made since the last step); then the functions with the most
cumulative and own time of the profiled call.
"""

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
os.environ.setdefault("KERAS_BACKEND", "torch")


def counting():
    """Wrap ``CapturedSteps.step`` to count each step's fate; returns the counter."""
    from kmgpu.engines.torch.capture import graphs

    counts = collections.Counter()
    step = graphs.CapturedSteps.step

    def counted(self, kind, data):
        before, generation = set(self.graphs), self._generation
        out = step(self, kind, data)
        key = self.last.get(kind)
        fate = ("replayed" if key in before and key in self.graphs else
                "captured" if key in self.graphs else
                f"eager ({self.refused[kind]})" if kind in self.refused else "eager")
        counts[(kind, fate)] += 1
        if generation != self._generation:
            counts[(kind, "graphs dropped: a flat buffer was made")] += 1
        return out

    graphs.CapturedSteps.step = counted
    return counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    import numpy as np

    import keras
    import keras_hub

    import kmgpu
    from keras_hub_lm import config

    counts = counting()
    keras.mixed_precision.set_global_policy("float32" if a.quick else "mixed_bfloat16")
    keras.utils.set_random_seed(0)
    cfg, length, batch = config(a.quick)
    model = keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(**cfg),
                                           preprocessor=None)
    if a.lora:
        model.backbone.enable_lora(rank=8)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), weighted_metrics=["accuracy"])
    rows = batch * a.steps
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg["vocabulary_size"], size=(rows, length + 1)).astype("int32")
    mask = np.ones_like(ids, dtype=bool)
    mask[::4, -length // 4:] = False
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, w = ids[:, 1:], mask[:, 1:].astype("float32")
    parallel = kmgpu.parallelize(model, gpus=1)
    fit = dict(sample_weight=w, batch_size=batch, shuffle=False, verbose=0)
    for epochs in (2, 1):
        counts.clear()
        t = time.perf_counter()
        parallel.fit(x, y, epochs=epochs, **fit)
        print(f"fit(epochs={epochs}): {time.perf_counter() - t:.2f} s; steps: "
              + ", ".join(f"{k[0]} {k[1]}: {n}" for k, n in sorted(counts.items())),
              flush=True)
    counts.clear()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    parallel.fit(x, y, epochs=1, **fit)
    prof.disable()
    print(f"profiled fit(epochs=1): {time.perf_counter() - t:.2f} s; steps: "
          + ", ".join(f"{k[0]} {k[1]}: {n}" for k, n in sorted(counts.items())), flush=True)
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
        print(out.getvalue())


if __name__ == "__main__":
    main()

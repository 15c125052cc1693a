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


def counted(fates):
    """``keras_hub_lm.step_fates``'s list as "kind fate: count, ...", with the steps after
    which the graphs were dropped."""
    counts = collections.Counter((kind, fate) for kind, fate, _ in fates)
    counts.update((kind, "graphs dropped: a flat buffer was made")
                  for kind, _, dropped in fates if dropped)
    return ", ".join(f"{k[0]} {k[1]}: {n}" for k, n in sorted(counts.items()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    import kmgpu
    from keras_hub_lm import lm, step_fates

    fates = step_fates()
    model, (x, y, w), batch = lm(a.quick, a.lora, a.steps)
    parallel = kmgpu.parallelize(model, gpus=1)
    fit = dict(sample_weight=w, batch_size=batch, shuffle=False, verbose=0)
    for epochs in (2, 1):
        fates.clear()
        t = time.perf_counter()
        parallel.fit(x, y, epochs=epochs, **fit)
        print(f"fit(epochs={epochs}): {time.perf_counter() - t:.2f} s; steps: "
              + counted(fates), flush=True)
    fates.clear()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    parallel.fit(x, y, epochs=1, **fit)
    prof.disable()
    print(f"profiled fit(epochs=1): {time.perf_counter() - t:.2f} s; steps: "
          + counted(fates), flush=True)
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(35)
        print(out.getvalue())


if __name__ == "__main__":
    main()

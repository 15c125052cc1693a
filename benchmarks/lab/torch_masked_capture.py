"""A masked sequence loss inside kmgpu's captured torch step, on one GPU.

Models: Embedding(mask_zero=True) -> LSTM(return_sequences) -> TimeDistributed(Dense), and
the same with Dense in place of the LSTM (Keras's torch LSTM with a mask runs a Python loop
that reads a tensor time counter on the host, so it cannot be captured: kmgpu says so and
trains it eagerly; the Dense model keeps the mask and captures), sparse categorical
crossentropy, padded sequences of varying lengths (0 = padding): Keras
divides the summed loss by the valid timesteps. Same initial weights, shuffle=False, 2
epochs, TF32 off everywhere (matmuls and cuDNN), against Keras's own fit on the same
device:

- ``kmgpu gpus=1``: ``parallelize(model, gpus=1, tf32=False)``: one replica, Keras's own
  loss inside the captured step (one replica has no all-reduce).
- ``split step, world 2``: the split step a rank of a 2-rank run builds (its loss through
  ``replica_loss``: a masked mean's valid timesteps summed over ranks by an all-reduce
  inside graph A), captured, with its all-reduces in a NCCL process group of one rank on
  this GPU (gloo on a CPU). Every row is this rank's (n_real = n_global), so the update
  must equal one device's. Each size-1 all-reduce (the valid-timestep sum) is recorded
  with whether the stream was capturing then, and every train step with whether it ran
  eagerly or replayed the graphs.

    KERAS_BACKEND=torch python benchmarks/lab/torch_masked_capture.py [--quick] [--out DIR]
"""

import argparse
import os
import time

import numpy as np
from torch_default import log, rel_diff

VOCAB, STEPS_LEN, CLASSES = 50, 12, 5


def data(rows):
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCAB, size=(rows, STEPS_LEN))
    lengths = rng.integers(2, STEPS_LEN + 1, size=rows)
    x[np.arange(STEPS_LEN)[None, :] >= lengths[:, None]] = 0  # padding: masked
    y = rng.integers(0, CLASSES, size=(rows, STEPS_LEN))
    return x.astype("int32"), y.astype("int32")


def model(units, kind="lstm"):
    import keras

    keras.utils.set_random_seed(7)
    middle = (keras.layers.LSTM(units, return_sequences=True) if kind == "lstm"
              else keras.layers.Dense(units, activation="tanh"))  # Dense keeps the mask
    m = keras.Sequential([
        keras.Input((STEPS_LEN,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 16, mask_zero=True), middle,
        keras.layers.TimeDistributed(keras.layers.Dense(CLASSES))])
    m.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


class Counts:
    """Train steps, eager steps and size-1 all-reduces (issued while capturing or not)."""

    def __init__(self):
        from kmgpu.engines.torch.capture import graphs
        from kmgpu.engines.torch.steps import split_step

        self.steps = self.eager = 0
        self.small_captured = self.small_eager = 0
        train, step = graphs.CapturedStep.train_step, split_step.SplitStep.step
        counts = self

        def counted_train(self, data):
            counts.steps += 1
            return train(self, data)

        def counted_step(self, *args):
            counts.eager += 1
            return step(self, *args)

        graphs.CapturedStep.train_step = graphs.CapturedStep.__call__ = counted_train
        split_step.SplitStep.step = counted_step

    def row(self):
        return dict(steps=self.steps, eager=self.eager, replayed=self.steps - self.eager,
                    masked_allreduce_in_capture=self.small_captured,
                    masked_allreduce_eager=self.small_eager)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows, batch, units = (96, 16, 8) if a.quick else (2048, 128, 64)
    x, y = data(rows)
    fit = dict(x=x, y=y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    log(f"device: {torch.cuda.get_device_name(0) if gpu else 'cpu'}; rows {rows}, batch "
        f"{batch}, units {units}, valid timesteps {int((x > 0).sum())} of {x.size}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    results = []
    for kind in ("dense", "lstm"):
        results += runs(kind, units, fit, gpu)
    dist.destroy_process_group()
    table(results, gpu, rows, batch, units, a.out)


def runs(kind, units, fit, gpu):
    """Plain Keras, kmgpu gpus=1 and the world-2 split step for one model kind."""
    import torch
    import torch.distributed as dist

    import kmgpu
    from kmgpu.engines.torch.capture import graphs
    from kmgpu.engines.torch.steps import split_step

    reference = model(units, kind)
    start = time.perf_counter()
    plain_loss = reference.fit(**fit).history["loss"]
    results = [(f"{kind}: Keras fit (plain)", 0.0, plain_loss, time.perf_counter() - start,
                None)]
    log("plain", plain_loss)

    counts = Counts()
    m = model(units, kind)
    parallel = kmgpu.parallelize(m, gpus=1, tf32=False)
    start = time.perf_counter()
    loss = parallel.fit(**fit).history["loss"]
    results.append((f"{kind}: kmgpu gpus=1 " + ("(captured step)" if gpu
                                                else "(Keras's step: CPU)"),
                    rel_diff(reference.get_weights(), m.get_weights()),
                    loss, time.perf_counter() - start, counts.row()))
    log("kmgpu gpus=1", results[-1])
    parallel.close()

    counts2 = Counts()

    def reduce(flats):
        for flat in flats:
            if flat.numel() == 1:
                capturing = gpu and torch.cuda.is_current_stream_capturing()
                if capturing:
                    counts2.small_captured += 1
                else:
                    counts2.small_eager += 1
            dist.all_reduce(flat)

    m2 = model(units, kind)
    split = split_step.SplitStep(m2, world=2, reduce=reduce,
                                 rows=lambda x: (split_step._num_rows(x),) * 2)
    step = graphs.CapturedStep(split, graphs.device_of(m2), tf32=False)
    start = time.perf_counter()
    with graphs.installed(m2, step):
        loss = m2.fit(**fit).history["loss"]
    results.append((f"{kind}: split step world 2, " + ("NCCL group of 1 (captured)" if gpu
                                                        else "gloo group of 1 (eager: CPU)"),
                    rel_diff(reference.get_weights(), m2.get_weights()), loss,
                    time.perf_counter() - start, counts2.row()))
    log("world 2", results[-1])
    step.close()
    return results


def table(results, gpu, rows, batch, units, out):
    import keras
    import torch

    head = ("| run | weights vs plain (rel.) | loss per epoch | fit s | train steps | eager "
            "steps | not eager (captured/replayed) | masked all-reduces recorded in a graph / "
            "eager |")
    lines = [head, "|" + "---|" * 8]
    for name, diff, loss, secs, c in results:
        c = c or {}
        lines.append(
            f"| {name} | {diff:.2e} | {', '.join(f'{v:.6f}' for v in loss)} | {secs:.1f} | "
            f"{c.get('steps', '-')} | {c.get('eager', '-')} | {c.get('replayed', '-')} | "
            f"{c.get('masked_allreduce_in_capture', '-')} / "
            f"{c.get('masked_allreduce_eager', '-')} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "torch-masked-capture.md"), "w") as f:
            f.write(f"device: {torch.cuda.get_device_name(0) if gpu else 'cpu'}, torch "
                    f"{torch.__version__}, keras {keras.__version__}; rows {rows}, batch "
                    f"{batch}, units {units}\n\n{text}\n")


if __name__ == "__main__":
    main()

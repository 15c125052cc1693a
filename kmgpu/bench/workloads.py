"""The benchmark workloads: a model with fixed initial weights (one seed), random data of
the right shapes, the batch, epochs, steps per epoch and loss, in full size (GPUs) or
``quick`` size (a 2-core CPU, for CI).

Models people train:
    xception        keras.applications.Xception, 224x224x3, 1000 classes; 32 samples per
                    GPU: global batch 32 x the largest device count (64 on 2 GPUs);
                    15 steps an epoch.
    resnet50        keras.applications.ResNet50, 224x224x3, 1000 classes, batch 256,
                    6 steps an epoch.
    resnet50_small  the same at 64x64 with 10 classes, batch 256, 12 steps an epoch (one
                    GPU's step is latency-bound: splitting the batch can only lose).
    transformer     GPT-style decoder LM: 4 blocks, d_model 512, 8 heads, FFN 2048,
                    sequence 256, vocabulary 8192, causal mask, batch 64, next-token
                    loss, 12 steps an epoch.
Toys (launch-bound; kept for continuity):
    cnn32           32x32x3; three stages of two 3x3 Conv (64, 128, 256) + BatchNorm,
                    max-pool after each; global average pool; Dense 10. Batch 256.
    lstm            64 steps x 16 features; LSTM 256 (sequences) -> LSTM 256; Dense 1.
    sine            kmgpu.sine: the reference scenario (LSTM(4) + Dense(1), batch 8).

Quick sizes keep each model's kind of block (separable-conv Xception blocks, ResNet
bottlenecks with BatchNorm, causal attention) and shrink depth, width, image, sequence,
steps and epochs (``models.xception_mini``, ``models.resnet_mini``).

Parity (weights after training against plain fit) means little for the models with
BatchNorm (statistics per replica) and for the transformer: its attention's key bias gets
a zero gradient (softmax ignores a shift), so Adam turns rounding noise into full steps.

``batch`` is the global batch of one device. Policy "global" keeps it on N devices;
"per_replica" gives each device ``batch`` (global N x batch). An epoch is ``steps``
steps at the run's global batch (random data; sine: its fixed 106 samples); ``epochs``
are the timed epochs, after the run's warm-up (``runners.py``).

The full sizes are chosen so that the default ``kmgpu bench`` on one GPU, every model on
JAX and torch, ends within 10 minutes: plain Keras on torch runs each layer from Python,
so its steps cost several times kmgpu's, and the steps per epoch are what keeps its rows
in the time budget. An epoch stays long enough (a few tenths of a second under kmgpu) for
its median to be steady.
"""

import dataclasses
import functools

import numpy as np

NAMES = ("xception", "resnet50", "resnet50_small", "transformer", "cnn32", "lstm", "sine")
TOYS = ("cnn32", "lstm", "sine")
# The default order of a run, small to large: the models people train (full size), every
# workload (--quick, where each takes seconds).
MODELS = ("transformer", "resnet50_small", "resnet50", "xception")
BY_SIZE = ("sine", "lstm", "cnn32") + MODELS
# Rough seconds of one run on one GPU, averaged over the runs of a workload's process
# (the first pays the process's start and the compile; on JAX the later ones load the
# compiled program), warm-up, epochs, evaluate and predict included, before any run of
# the workload has been timed: the time budget's first guess (plan.Budget scales it by
# the backend's finished runs). Per backend for the models people train, from the runs'
# walls of the default run in benchmarks/results/nvidia-h100-80gb-hbm3-x1.json (torch's
# Xception, skipped there, from the run before it, less its two more epochs): JAX
# compiles each model first (Xception for much longer than torch takes to run it), torch's
# plain fit runs each layer from Python.
GPU_SECONDS = {"sine": 10, "lstm": 10, "cnn32": 12,
               "transformer": {"jax": 16, "torch": 11},
               "resnet50_small": {"jax": 15, "torch": 12},
               "resnet50": {"jax": 16, "torch": 16}, "xception": {"jax": 40, "torch": 15}}
QUICK_SECONDS = 4  # one --quick run on a 2-core CPU
# Timed epochs of the models people train, after each run's warm-up (runners.py): their
# median is samples/s. Three keep the slowest rows (plain Keras on torch) in the budget.
EPOCHS = 3
SEED = 1234
UNIQUE_IMAGES = 256  # big image sets repeat this many random samples (same shapes and cost)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    quick: bool
    batch: int
    epochs: int
    steps: int
    loss: str  # "sparse_ce_logits" or "mse"
    kind: str  # "conv" or "matmul": which TF32 switch applies on torch
    input_shape: tuple
    classes: int = 0  # labels (transformer: the vocabulary)
    builder: str = ""
    args: tuple = ()  # builder keyword arguments, as (name, value) pairs
    description: str = ""

    @property
    def toy(self):
        return self.name in TOYS

    def samples(self, global_batch=None):
        """Samples per epoch at ``global_batch`` (default: the one-device batch)."""
        if self.name == "sine":
            from kmgpu import sine

            return len(sine.data()[0][0])
        return self.steps * (global_batch or self.batch)

    # -- model and data -----------------------------------------------------------
    def build(self):
        """A new model with the workload's fixed initial weights (same seed each call)."""
        import keras

        from kmgpu.bench import models

        keras.utils.set_random_seed(SEED)
        if self.name == "sine":
            from kmgpu import sine

            return sine.model(seed=SEED)
        return getattr(models, self.builder)(**dict(self.args))

    @functools.lru_cache(maxsize=2)  # a process runs one or two sizes of a workload
    def data(self, global_batch=None):
        """(x, y) for one epoch at ``global_batch``: float32 inputs (int32 tokens for the
        transformer), int32 labels or float32 targets. The same arrays for the same size:
        made once per process (an epoch of 224x224 images is large), shared by its runs,
        which only read them."""
        n = self.samples(global_batch)
        rng = np.random.default_rng(SEED)
        if self.name == "sine":
            from kmgpu import sine

            (x, y), _, _ = sine.data()
            return x, y
        if self.name == "lstm":
            x = rng.standard_normal((n, *self.input_shape), dtype=np.float32)
            return x, x[:, -8:, :].mean(axis=(1, 2))[:, None].astype("float32")
        if self.name == "transformer":
            tokens = rng.integers(0, self.classes, size=(n, self.input_shape[0] + 1))
            tokens = tokens.astype("int32")
            return tokens[:, :-1], tokens[:, 1:]  # next-token targets
        unique = n if self.name == "cnn32" else min(n, UNIQUE_IMAGES)
        x = rng.standard_normal((unique, *self.input_shape), dtype=np.float32)
        if unique < n:
            x = np.resize(x, (n, *self.input_shape))
        y = rng.integers(0, self.classes, size=(n,)).astype("int32")
        return x, y

    def compile_args(self):
        import keras

        loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                if self.loss == "sparse_ce_logits" else "mse")
        return {"optimizer": keras.optimizers.Adam(learning_rate=1e-3), "loss": loss}

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["args"] = dict(self.args)
        d["input_shape"] = list(self.input_shape)
        d["samples"] = self.samples()
        d["toy"] = self.toy
        return d


def prior_seconds(quick, gpu):
    """{workload: a run's guessed seconds} for ``plan.Budget`` (empty: no guess)."""
    if quick:
        return {name: QUICK_SECONDS for name in NAMES}
    return dict(GPU_SECONDS) if gpu else {}


def _image(name, quick, batch, epochs, steps, image, classes, builder, args, description):
    return Workload(name, quick, batch, epochs, steps, "sparse_ce_logits", "conv",
                    (image, image, 3), classes, builder, tuple(sorted(args.items())),
                    description)


def get(name, quick=False, devices=2, epochs=None, steps=None):
    """The workload ``name`` in full or quick size.

    Args:
        name: one of ``NAMES``.
        quick: CPU sizes.
        devices: the largest device count of the run (xception's batch is 32 per device
            at that count).
        epochs, steps: override the epochs and the steps per epoch (sine: epochs only).
    """
    w = _catalogue(name, quick, max(1, int(devices)))
    changes = {}
    if epochs:
        changes["epochs"] = int(epochs)
    if steps and name != "sine":
        changes["steps"] = int(steps)
    return dataclasses.replace(w, **changes) if changes else w


def _catalogue(name, quick, devices):
    from kmgpu import sine

    if name == "xception":
        if quick:
            return _image(name, True, 8 * devices, 3, 2, 32, 10, "xception_mini",
                          {"image": 32, "classes": 10, "width": 4, "entry": 1, "middle": 1},
                          "Xception-style (1 entry block, 1 middle block, width 4), 32x32")
        return _image(name, False, 32 * devices, EPOCHS, 15, 224, 1000, "application",
                      {"name": "Xception", "image": 224, "classes": 1000},
                      f"keras.applications.Xception 224x224, 1000 classes, 32/GPU at "
                      f"{devices} GPUs")
    if name in ("resnet50", "resnet50_small"):
        small = name == "resnet50_small"
        image, classes = (64, 10) if small else (224, 1000)
        if quick:
            image, classes = (16, 10) if small else (32, 20)
            return _image(name, True, 16, 3, 2, image, classes, "resnet_mini",
                          {"image": image, "classes": classes, "width": 4, "blocks": (1, 1)},
                          f"ResNet-style (2 stages of 1 bottleneck, width 4), {image}x{image}")
        return _image(name, False, 256, EPOCHS, 12 if small else 6, image, classes,
                      "application",
                      {"name": "ResNet50", "image": image, "classes": classes},
                      f"keras.applications.ResNet50 {image}x{image}, {classes} classes")
    if name == "transformer":
        size = (dict(vocab=128, seq=16, d_model=32, heads=2, ffn=64, blocks=2) if quick else
                dict(vocab=8192, seq=256, d_model=512, heads=8, ffn=2048, blocks=4))
        return Workload(name, quick, 16 if quick else 64, 3 if quick else EPOCHS,
                        2 if quick else 12,
                        "sparse_ce_logits", "matmul", (size["seq"],), size["vocab"],
                        "transformer", tuple(sorted(size.items())),
                        "GPT-style decoder LM: {blocks} blocks, d_model {d_model}, {heads} "
                        "heads, FFN {ffn}, seq {seq}, vocab {vocab}, causal".format(**size))
    if name == "cnn32":
        width = 8 if quick else 64
        return Workload(name, quick, 64 if quick else 256, 3 if quick else 6,
                        2 if quick else 60, "sparse_ce_logits", "conv", (32, 32, 3), 10,
                        "cnn32", (("width", width),),
                        f"Conv {width}/{2 * width}/{4 * width} x2 + BN, 32x32")
    if name == "lstm":
        width, steps = (32, 16) if quick else (256, 64)
        return Workload(name, quick, 64 if quick else 256, 3 if quick else 6,
                        2 if quick else 40, "mse", "matmul", (steps, 16), 0, "lstm",
                        (("steps", steps), ("width", width)),
                        f"LSTM {width} x2 over {steps}x16")
    if name == "sine":
        n = len(sine.data()[0][0])
        return Workload("sine", quick, sine.BATCH, 5 if quick else sine.EPOCHS, 0, "mse",
                        "matmul", (1, 1), 0, "sine", (),
                        f"kmgpu.sine: LSTM(4) + Dense(1), {n} samples, seed {SEED}")
    raise ValueError(f"unknown workload {name!r}: choose from {', '.join(NAMES)}")

"""The benchmark workloads: a model (fixed initial weights from a seed), its data,
batch, epochs and loss, in full size (GPUs) or ``quick`` size (a CPU, for CI).

    cnn32  32x32x3 inputs; three stages of two 3x3 Conv (64, 128, 256) + BatchNorm,
           max-pool after each stage; global average pool; Dense 10. Batch 256.
    lstm   64 steps x 16 features; LSTM 256 (sequences) -> LSTM 256; Dense 1. Batch 256.
    sine   kmgpu.sine: the reference scenario (LSTM(4) + Dense(1), batch 8, 100 epochs).

Quick sizes keep the layer structure and shrink widths, samples and epochs.
"""

import dataclasses

import numpy as np

NAMES = ("cnn32", "lstm", "sine")
SEED = 1234


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    quick: bool
    batch: int
    epochs: int
    samples: int
    loss: str  # "sparse_ce_logits" or "mse"
    width: int  # cnn32: first stage filters; lstm: units
    steps: int = 64  # lstm: time steps
    description: str = ""

    # -- model and data -----------------------------------------------------------
    def build(self):
        """A new model with the workload's fixed initial weights (same seed each call)."""
        import keras

        keras.utils.set_random_seed(SEED)
        if self.name == "cnn32":
            inputs = keras.Input((32, 32, 3))
            h = inputs
            for stage in range(3):
                for _ in range(2):
                    h = keras.layers.Conv2D(self.width * 2**stage, 3, padding="same",
                                            use_bias=False)(h)
                    h = keras.layers.BatchNormalization()(h)
                    h = keras.layers.Activation("relu")(h)
                h = keras.layers.MaxPooling2D()(h)
            h = keras.layers.GlobalAveragePooling2D()(h)
            return keras.Model(inputs, keras.layers.Dense(10)(h), name="cnn32")
        if self.name == "lstm":
            return keras.Sequential([
                keras.Input((self.steps, 16)),
                keras.layers.LSTM(self.width, return_sequences=True),
                keras.layers.LSTM(self.width),
                keras.layers.Dense(1),
            ], name="lstm")
        if self.name == "sine":
            from kmgpu import sine

            return sine.model(seed=SEED)
        raise ValueError(self.name)

    def data(self):
        """(x, y) training arrays, float32 (int32 class labels for cnn32)."""
        rng = np.random.default_rng(SEED)
        if self.name == "cnn32":
            x = rng.standard_normal((self.samples, 32, 32, 3), dtype=np.float32)
            y = rng.integers(0, 10, size=(self.samples,)).astype("int32")
            return x, y
        if self.name == "lstm":
            x = rng.standard_normal((self.samples, self.steps, 16), dtype=np.float32)
            y = x[:, -8:, :].mean(axis=(1, 2))[:, None].astype("float32")
            return x, y
        if self.name == "sine":
            from kmgpu import sine

            (x, y), _, _ = sine.data()
            return x, y
        raise ValueError(self.name)

    def compile_args(self):
        import keras

        loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                if self.loss == "sparse_ce_logits" else "mse")
        return {"optimizer": keras.optimizers.Adam(learning_rate=1e-3), "loss": loss}

    def to_dict(self):
        return dataclasses.asdict(self)


def get(name, quick=False):
    """The workload ``name`` ("cnn32", "lstm", "sine") in full or quick size."""
    from kmgpu import sine

    if name == "cnn32":
        if quick:
            return Workload("cnn32", True, batch=64, epochs=4, samples=256,
                            loss="sparse_ce_logits", width=8,
                            description="cnn32 at 1/8 width (8/16/32 filters), 256 samples")
        return Workload("cnn32", False, batch=256, epochs=6, samples=256 * 60,
                        loss="sparse_ce_logits", width=64,
                        description="Conv 64/128/256 x2 + BN, 15360 samples")
    if name == "lstm":
        if quick:
            return Workload("lstm", True, batch=64, epochs=4, samples=256, loss="mse",
                            width=32, steps=16,
                            description="LSTM 32 x2 over 16 steps, 256 samples")
        return Workload("lstm", False, batch=256, epochs=6, samples=256 * 40, loss="mse",
                        width=256, steps=64, description="LSTM 256 x2 over 64x16, 10240 samples")
    if name == "sine":
        (x, _), _, _ = sine.data()
        n = len(x)
        return Workload("sine", quick, batch=sine.BATCH, epochs=5 if quick else sine.EPOCHS,
                        samples=n, loss="mse", width=4,
                        description=f"kmgpu.sine: LSTM(4) + Dense(1), {n} samples, seed {SEED}")
    raise ValueError(f"unknown workload {name!r}: choose from {', '.join(NAMES)}")

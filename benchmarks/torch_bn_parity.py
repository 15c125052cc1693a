"""Is kmgpu's fused BatchNorm (engines/torch/fast_layers, used inside kmgpu's torch steps
on CUDA) as close to the exact result as Keras's own BatchNormalization? One GPU (or a
CPU at --quick sizes): the same start, the same batches, TF32 off, cuDNN deterministic:

  keras       plain Keras fit, float32 (Keras's BatchNormalization)
  keras again the same (the GPU's run-to-run noise)
  kmgpu       kmgpu.parallelize(model, gpus=1, tf32=False): captured step, fused BatchNorm
  float64     plain Keras fit with every variable and op in float64: the reference

Prints, per model, the distance of each float32 run from the float64 one and from each
other: max relative (per variable, the worst; a zero-start bias moved by a few steps makes
it large for any change of rounding) and the norm relative (all weights as one vector).

    KERAS_BACKEND=torch python benchmarks/torch_bn_parity.py [--quick] [--steps 6]
"""

import argparse
import contextlib
import io

import numpy as np

# the weights measure and the exact-arithmetic settings of torch_default.py's parity column
from torch_default import exact, rel_diff as rel_max


def rel_norm(a, b):
    u = np.concatenate([np.ravel(t) for t in a]).astype(np.float64)
    v = np.concatenate([np.ravel(t) for t in b]).astype(np.float64)
    return float(np.linalg.norm(u - v) / np.linalg.norm(u))


def convnet(image):
    import keras

    L = keras.layers
    inputs = keras.Input((image, image, 3))
    h = inputs
    for filters, stride in ((16, 1), (32, 2), (32, 1), (64, 2)):
        h = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(h)
        h = L.BatchNormalization()(h)
        h = L.Activation("relu")(h)
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, L.Dense(10)(h))


def resnet(image):
    import keras

    return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=10)


def run(build, image, batch, steps, offset):
    import keras

    import kmgpu

    rng = np.random.default_rng(0)
    x = (rng.random((batch * steps, image, image, 3)) + offset).astype("float32")
    y = rng.integers(0, 10, batch * steps)
    keras.utils.set_random_seed(1)
    model = build(image)
    init = model.get_weights()
    compile_args = lambda: dict(  # noqa: E731
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = {}
    with exact():
        for name in ("keras", "kmgpu", "keras again"):
            model.set_weights(init)
            runner = kmgpu.parallelize(model, gpus=1, tf32=False) if name == "kmgpu" else model
            runner.compile(**compile_args())
            with contextlib.redirect_stdout(io.StringIO()):
                runner.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            out[name] = [np.array(w) for w in model.get_weights()]
            if name == "kmgpu":
                runner.close()
        keras.config.set_floatx("float64")
        try:
            keras.utils.set_random_seed(1)
            ref = build(image)
            ref.set_weights([w.astype("float64") for w in init])
            ref.compile(**compile_args())
            ref.fit(x.astype("float64"), y, batch_size=batch, epochs=1, shuffle=False,
                    verbose=0)
            out["float64"] = [np.array(w) for w in ref.get_weights()]
        finally:
            keras.config.set_floatx("float32")
    return out


def main():
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    cases = [("conv+BN x4, inputs in [0, 1)", convnet, 32, 64, 0.0),
             ("conv+BN x4, inputs in [5, 6) (large mean)", convnet, 32, 64, 5.0),
             ("ResNet50 64x64", resnet, 64, 64, 0.0)]
    if args.quick:
        cases = [(n, b, 8, 4, o) for n, b, _, _, o in cases[:2]]
    print("| model | keras vs float64 (max / norm) | kmgpu vs float64 (max / norm) | "
          "kmgpu vs keras (max / norm) | keras vs keras again |")
    print("|---|---|---|---|---|")
    for name, build, image, batch, offset in cases:
        r = run(build, image, batch, args.steps, offset)
        f = lambda a, b: f"{rel_max(r[a], r[b]):.1e} / {rel_norm(r[a], r[b]):.1e}"  # noqa: E731
        print(f"| {name} | {f('float64', 'keras')} | {f('float64', 'kmgpu')} | "
              f"{f('keras', 'kmgpu')} | {f('keras', 'keras again')} |", flush=True)


if __name__ == "__main__":
    main()

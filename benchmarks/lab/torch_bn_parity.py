"""kmgpu's fused BatchNorm (engines/torch/fast/layers.py, inside kmgpu's torch steps on
CUDA) against Keras's own BatchNormalization: how close each is to float64, and how fast.
One GPU (or a CPU at --quick sizes, where kmgpu's steps keep Keras's layer). The variants:

  keras's BN      Keras's own layer (plain fit, or kmgpu with KMGPU_TORCH_FUSED_BN=0)
  fused, native   fast_layers as it is: torch's own CUDA batch-norm kernels (the default)
  fused, cudnn    F.batch_norm as it comes: cuDNN, persistent mode for channels-last
                  training (the fused layer before this change)
  fused, nchw     F.batch_norm on a contiguous NCHW copy (cuDNN's ordinary mode)

The yardstick is float64 with ``fast_layers.reference_call`` as the BatchNorm: Keras's own
layer computes in float32 even in a float64 model (``backend.result_type`` turns float64
into float32), so a float64 run of Keras's layer ("float64, Keras's BN") shares Keras's
float32 BatchNorm arithmetic, and Keras's float32 layer looks closer to it than it is.

--part layers  one layer, one training step: output, gradients (inputs, gamma, beta), moving
               statistics, each a norm-relative distance from float64, per variant
--part train   plain Keras, and kmgpu with the fused layer (native, cudnn; on a CPU kmgpu
               keeps Keras's layer): 6 steps of Adam (TF32 off, cuDNN deterministic) from the same start on the
               same batches: the weights' distance from each float64 run (max: worst
               per-variable relative difference; norm: all weights as one vector)
--part speed   kmgpu's step (TF32 on, its default), samples/s (median epoch after the first),
               in the order keras's BN, native, cudnn, native, keras's BN in one process:
               the better of each's runs (the worse in brackets)

    KERAS_BACKEND=torch python benchmarks/lab/torch_bn_parity.py [--quick] [--part layers train speed]
"""

import argparse
import contextlib
import io
import os
import statistics
import time

import numpy as np

# the weights measure, the exact-arithmetic settings, the CUDA probe and the epoch timer of
# torch_default.py
from torch_default import cuda, epoch_timer, exact, rel_diff as rel_max

T0 = time.perf_counter()
VARIANTS = {"keras's BN": None, "fused, native": "native", "fused, cudnn": "cudnn",
            "fused, nchw": "nchw"}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def rel_norm(a, b):
    u = np.concatenate([np.ravel(t) for t in a]).astype(np.float64)
    v = np.concatenate([np.ravel(t) for t in b]).astype(np.float64)
    return float(np.linalg.norm(u - v) / np.linalg.norm(u))


@contextlib.contextmanager
def variant(name):
    """kmgpu's steps use this BatchNorm variant within the block."""
    from kmgpu.engines.torch.fast import layers as fast_layers

    kernel, saved = VARIANTS[name], (os.environ.get("KMGPU_TORCH_FUSED_BN"),
                                     fast_layers.CUDA_KERNEL)
    os.environ["KMGPU_TORCH_FUSED_BN"] = "0" if kernel is None else "1"
    fast_layers.CUDA_KERNEL = kernel or "native"
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("KMGPU_TORCH_FUSED_BN")
        else:
            os.environ["KMGPU_TORCH_FUSED_BN"] = saved[0]
        fast_layers.CUDA_KERNEL = saved[1]


@contextlib.contextmanager
def batch_norm_call(call):
    """Keras's BatchNormalization runs ``call`` within the block (None: its own)."""
    from keras.src.layers.normalization import batch_normalization

    cls = batch_normalization.BatchNormalization
    keras_call = cls.call
    cls.call = call or keras_call
    try:
        yield
    finally:
        cls.call = keras_call


@contextlib.contextmanager
def float64(batch_norm):
    """A float64 Keras with ``batch_norm`` ("exact": reference_call; "keras": Keras's own)."""
    import keras

    from kmgpu.engines.torch.fast import layers as fast_layers

    keras.config.set_floatx("float64")
    try:
        with batch_norm_call(fast_layers.reference_call if batch_norm == "exact" else None):
            yield
    finally:
        keras.config.set_floatx("float32")


# -- one layer -------------------------------------------------------------------------------
def one_layer(call, x, up, dtype, **kw):
    import keras
    import torch

    c = x.shape[-1]
    layer = keras.layers.BatchNormalization(dtype=dtype, **kw)
    layer.build(x.shape)
    rng = np.random.default_rng(1)
    layer.set_weights([rng.uniform(0.5, 1.5, c) if w.name in ("gamma", "moving_variance")
                       else rng.standard_normal(c) for w in layer.weights])
    dev = "cuda" if cuda() else "cpu"
    xx = torch.as_tensor(x, dtype=getattr(torch, dtype), device=dev).requires_grad_(True)
    if x.ndim == 4:
        xx = xx.detach().to(memory_format=torch.channels_last).requires_grad_(True)
    out = call(layer, xx, training=True)
    affine = [v.value if v is not None else None for v in (layer.gamma, layer.beta)]
    grads = torch.autograd.grad((out * torch.as_tensor(up, dtype=out.dtype, device=dev)).sum(),
                                [xx] + [v for v in affine if v is not None])
    grads = list(grads[:1]) + [grads[1 + sum(a is not None for a in affine[:i])]
                               if affine[i] is not None else None for i in range(2)]
    return [t if t is None else t.detach().double().cpu().numpy()
            for t in (out, *grads, layer.moving_mean.value, layer.moving_variance.value)]


def part_layers(quick):
    import keras

    from kmgpu.engines.torch.fast import layers as fast_layers

    keras_call = keras.layers.BatchNormalization.call
    fused = fast_layers.batch_norm_method(keras_call)
    shapes = [(8, 6, 6, 4), (256, 4)] if quick else [(64, 32, 32, 64), (4096, 256)]
    print("\n| input (channels last) | mean | variant | output | d inputs | d gamma | d beta |"
          " moving mean | moving variance |\n|---|---|---|---|---|---|---|---|---|---|")
    cases = [(shape, offset, {}) for shape in shapes for offset in (0.0, 5.0, 100.0)]
    # one affine tensor without the other (InceptionV3: scale=False)
    cases += [(shapes[0], 5.0, {"scale": False}), (shapes[0], 5.0, {"center": False})]
    for shape, offset, kw in cases:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape) * 2 + offset
        up = rng.standard_normal(shape)
        ref = one_layer(fast_layers.reference_call, x, up, "float64", **kw)
        for name, kernel in VARIANTS.items():
            fast_layers.CUDA_KERNEL = kernel or "native"
            got = one_layer(keras_call if kernel is None else fused, x, up, "float32", **kw)
            fast_layers.CUDA_KERNEL = "native"
            d = ["-" if r is None else f"{np.linalg.norm(g - r) / np.linalg.norm(r):.1e}"
                 for g, r in zip(got, ref)]
            label = f"{shape}" + "".join(f" {k}={v}" for k, v in kw.items())
            print(f"| {label} | {offset:g} | {name} | " + " | ".join(d) + " |", flush=True)


# -- training --------------------------------------------------------------------------------
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


def efficientnet(image):
    import keras

    return keras.applications.EfficientNetB0(weights=None, input_shape=(image, image, 3),
                                             classes=10)


def compile_args():
    import keras

    return dict(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def train(build, image, batch, steps, offset, kmgpu_variants):
    import keras

    import kmgpu

    rng = np.random.default_rng(0)
    x = (rng.random((batch * steps, image, image, 3)) + offset).astype("float32")
    y = rng.integers(0, 10, batch * steps)
    keras.utils.set_random_seed(1)
    model = build(image)
    init = model.get_weights()
    fit = dict(batch_size=batch, epochs=1, shuffle=False, verbose=0)
    out = {}
    with exact():
        model.compile(**compile_args())
        model.fit(x, y, **fit)
        out["plain Keras"] = model.get_weights()
        if not cuda():  # kmgpu keeps Keras's layer on a CPU: the fused one in a plain fit
            from kmgpu.engines.torch.fast import layers as fast_layers

            model.set_weights(init)
            with batch_norm_call(fast_layers.batch_norm_method(
                    keras.layers.BatchNormalization.call)):
                model.compile(**compile_args())
                model.fit(x, y, **fit)
            out["plain Keras, fused BN"] = model.get_weights()
        for name in kmgpu_variants:
            model.set_weights(init)
            with variant(name):
                runner = kmgpu.parallelize(model, gpus=1, tf32=False)
                runner.compile(**compile_args())
                with contextlib.redirect_stdout(io.StringIO()):
                    runner.fit(x, y, **fit)
                runner.close()
            out[f"kmgpu, {name}"] = model.get_weights()
        for batch_norm in ("exact", "keras"):
            with float64(batch_norm):
                keras.utils.set_random_seed(1)
                ref = build(image)
                ref.set_weights([w.astype("float64") for w in init])
                ref.compile(**compile_args())
                ref.fit(x.astype("float64"), y, **fit)
                out[f"float64, {batch_norm}"] = ref.get_weights()
    return out


def part_train(quick, steps):
    cases = [("conv+BN x4, inputs in [0, 1)", convnet, 32, 64, 0.0),
             ("conv+BN x4, inputs in [5, 6)", convnet, 32, 64, 5.0),
             ("ResNet50 64x64", resnet, 64, 64, 0.0)]
    if quick:
        cases = [(n, b, 8, 4, o) for n, b, _, _, o in cases[:2]]
    names = ["fused, native", "fused, cudnn"] if cuda() else ["keras's BN"]
    print("\n| model | run | vs float64, exact BN (max / norm) | vs float64, Keras's BN "
          "(max / norm) |\n|---|---|---|---|")
    for name, build, image, batch, offset in cases:
        r = train(build, image, batch, steps, offset, names)
        for run in r:
            if run.startswith("float64"):
                continue
            d = [f"{rel_max(r[ref], r[run]):.1e} / {rel_norm(r[ref], r[run]):.1e}"
                 for ref in ("float64, exact", "float64, keras")]
            print(f"| {name} | {run} | {d[0]} | {d[1]} |", flush=True)
        d = f"{rel_max(r['float64, exact'], r['float64, keras']):.1e} / " \
            f"{rel_norm(r['float64, exact'], r['float64, keras']):.1e}"
        print(f"| {name} | float64, Keras's BN | {d} | 0 |", flush=True)


# -- speed -----------------------------------------------------------------------------------
def samples_per_s(model, init, x, y, batch, epochs, name):
    import kmgpu

    model.set_weights(init)
    with variant(name):
        runner = kmgpu.parallelize(model, gpus=1)
        runner.compile(**compile_args())
        timer = epoch_timer()
        with contextlib.redirect_stdout(io.StringIO()):
            runner.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                       callbacks=[timer])
        runner.close()
    return len(x) / statistics.median(timer.times[1:])


def part_speed(quick):
    import keras

    cases = [("ResNet-50 64x64, batch 256", resnet, 64, 256, 8),
             ("EfficientNetB0 128x128, batch 64", efficientnet, 128, 64, 16)]
    if quick:
        cases = [("conv+BN x4 16x16, batch 16", convnet, 16, 16, 2)]
    names = ["keras's BN", "fused, native", "fused, cudnn"]
    order = ["keras's BN", "fused, native", "fused, cudnn", "fused, native", "keras's BN"]
    print("\n| model | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for title, build, image, batch, steps in cases:
        keras.utils.set_random_seed(1)
        model = build(image)
        init = model.get_weights()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch * steps, image, image, 3), dtype=np.float32)
        y = rng.integers(0, 10, batch * steps)
        got = {n: [] for n in names}
        for name in order:
            got[name].append(samples_per_s(model, init, x, y, batch, 3, name))
            log(title, name, f"{got[name][-1]:,.0f} samples/s")
        print(f"| {title} | " + " | ".join(f"{max(got[n]):,.0f} ({min(got[n]):,.0f})"
                                           for n in names) + " |", flush=True)


def main():
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--part", nargs="+", default=["layers", "train", "speed"],
                   choices=["layers", "train", "speed"])
    args = p.parse_args()
    import torch

    log(f"torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if cuda() else 'CPU, kmgpu keeps Keras BN'}")
    for part in args.part:
        {"layers": lambda: part_layers(args.quick),
         "train": lambda: part_train(args.quick, args.steps),
         "speed": lambda: part_speed(args.quick)}[part]()
        log(part, "done")


if __name__ == "__main__":
    main()

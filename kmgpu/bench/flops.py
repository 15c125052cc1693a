"""Model FLOPs per training sample, the GPU's peak FLOP/s, and MFU.

FLOPs of one training step (forward + backward of the loss; the optimizer update is not
model FLOPs), divided by the batch, measured the backend's own way where there is one:

    jax         XLA's cost analysis of the jitted gradient, ``jax.jit(grad(loss)).lower(...)
                .cost_analysis()`` (HLO before optimisation; no compile)
    torch       ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward
                (matmuls, convolutions, attention)
    tensorflow  TF's graph profiler (``float_operation``) over the forward + backward graph
                (where it sees at least half the analytic count: it misses RNN loops)
    otherwise   ``analytic``: 3 x the forward FLOPs of the conv / dense / attention / RNN
                layers (a multiply-add is 2 FLOPs; the backward pass costs 2 forwards)

MFU = FLOPs per sample x samples/s / (devices x peak dense FLOP/s of one GPU for the
precision in use). Which precision: Keras's mixed bfloat16/float16 policy -> BF16;
float32 with TF32 allowed (JAX's default matmul precision on GPUs; torch's
``cudnn.allow_tf32`` for convolutions, ``cuda.matmul.allow_tf32`` for matmuls, or inside
kmgpu's steps its own ``parallelize(..., tf32=...)``; TF's ``tensor_float_32_execution``)
-> TF32; else FP32.
"""

import math

# Dense (no structured sparsity) peak FLOP/s per GPU, from NVIDIA's data sheets (SXM).
PEAKS = {
    "H200": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12},
    "H100": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
}
PRECISION_NAMES = {"fp32": "FP32 (no TF32)", "tf32": "TF32", "bf16": "BF16"}


def peak_flops(device_name, precision):
    """Peak dense FLOP/s of one ``device_name`` GPU at ``precision`` ("fp32", "tf32",
    "bf16"), or None where the table has no such GPU (CPUs, unknown GPUs)."""
    if not device_name:
        return None
    upper = device_name.upper()
    for key, peaks in PEAKS.items():
        if key in upper:
            return peaks.get(precision)
    return None


def mfu(flops_per_sample, samples_per_s, devices, peak):
    """Model FLOPs utilisation: achieved model FLOP/s over ``devices`` x ``peak``."""
    if not (flops_per_sample and samples_per_s and devices and peak):
        return None
    return flops_per_sample * samples_per_s / (devices * peak)


def precision(backend, kind, torch_tf32=None):
    """The arithmetic the GPU uses for a float32 ``kind`` ("conv"/"matmul") workload here:
    "bf16", "tf32" or "fp32" (see the module docstring). ``torch_tf32``: the run's torch
    steps set TF32 themselves (kmgpu's ``tf32``), whatever torch's global flags say."""
    import os

    import keras

    compute = keras.config.dtype_policy().compute_dtype
    if compute in ("bfloat16", "float16"):
        return "bf16"
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return "fp32"
    try:
        if backend == "jax":
            import jax

            value = str(jax.config.jax_default_matmul_precision or "default").lower()
            return "fp32" if value in ("highest", "float32") else "tf32"
        if backend == "torch":
            import torch

            if torch_tf32 is not None:
                return "tf32" if torch_tf32 else "fp32"
            on = (torch.backends.cudnn.allow_tf32 if kind == "conv"
                  else torch.backends.cuda.matmul.allow_tf32)
            return "tf32" if on else "fp32"
        if backend == "tensorflow":
            import tensorflow as tf

            return "tf32" if tf.config.experimental.tensor_float_32_execution_enabled() \
                else "fp32"
    except Exception:
        pass
    return "fp32"


# -- FLOPs per sample ----------------------------------------------------------------
def per_sample(model, workload, backend, x=None, y=None, batch=2):
    """(FLOPs per training sample, source) for ``model`` (built, any state), counted on
    the first ``batch`` samples of ``x``, ``y`` (default: the workload's data).

    Uses the backend's own counter and falls back to ``analytic``; source says which
    (and why the fallback, when the counter failed).
    """
    if x is None:
        x, y = workload.data()
    x, y = x[:batch], y[:batch]
    counter = {"jax": _jax, "torch": _torch, "tensorflow": _tensorflow}.get(backend)
    why = "no counter for this backend"
    estimate = analytic(model)
    if counter is not None:
        try:
            flops, source = counter(model, workload, x, y)
            flops = flops / len(x) if flops else 0.0
            if backend == "tensorflow" and flops < 0.5 * estimate:
                # TF's profiler does not see into while loops (RNN layers).
                why = f"{source} counted {flops:.3g}: it does not see inside loops"
            elif flops > 0:
                return flops, source
            else:
                why = f"{source} counted nothing"
        except Exception as e:  # a counter is a diagnostic: never fail the run for it
            why = f"{backend} counter failed: {type(e).__name__}"
    return estimate, f"analytic ({why})"


def _loss(workload, y, out):
    import keras

    if workload.loss == "sparse_ce_logits":
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            y, out, from_logits=True))
    return keras.ops.mean(keras.losses.mean_squared_error(y, out))


def _jax(model, workload, x, y):
    import jax

    def spec(v):
        return jax.ShapeDtypeStruct(tuple(v.shape), v.dtype)

    trainable = [spec(v) for v in model.trainable_variables]
    other = [spec(v) for v in model.non_trainable_variables]

    def loss(trainable, other, x, y):
        out, _ = model.stateless_call(trainable, other, x, training=True)
        return _loss(workload, y, out)

    lowered = jax.jit(jax.grad(loss)).lower(trainable, other, spec(x), spec(y))
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0)), \
        "XLA cost analysis of jax.jit(grad(loss)).lower()"


def _torch(model, workload, x, y):
    import keras
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    xs, ys = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    try:
        with FlopCounterMode(display=False) as counter:
            loss = _loss(workload, ys, model(xs, training=True))
            loss.backward()
    finally:
        for v in model.trainable_variables:
            v.value.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return float(counter.get_total_flops()), "torch.utils.flop_counter.FlopCounterMode"


def _tensorflow(model, workload, x, y):
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(workload, y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                       tf.TensorSpec(y.shape, y.dtype)).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    profile = tf.compat.v1.profiler.profile(graph=graph, run_meta=tf.compat.v1.RunMetadata(),
                                            cmd="op", options=options)
    return float(profile.total_float_ops), "TF profiler float_operation (forward + backward graph)"


def analytic(model):
    """3 x forward FLOPs per sample of the model's conv, dense, attention and RNN layers
    (nested models included; normalisation, activations and pooling not counted)."""
    return 3.0 * sum(layer_flops(layer) for layer in _leaf_layers(model))


def _leaf_layers(model):
    import keras

    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer)
        else:
            yield layer


def _size(variable):
    return math.prod(int(d) for d in variable.shape)


def layer_flops(layer):
    """Forward FLOPs per sample of one layer, from its weights and output shape:
    kernels (Dense, EinsumDense, Conv*, DepthwiseConv*): 2 x kernel size x output
    positions; SeparableConv: depthwise + pointwise the same way; LSTM/GRU/SimpleRNN:
    2 x (kernel + recurrent kernel) per time step; MultiHeadAttention (self-attention):
    its projections plus 2 x 2 x T^2 x heads x key_dim for scores and weighted values."""
    import keras

    L = keras.layers
    try:
        out = tuple(layer.output.shape)
    except Exception:  # not called in a functional graph
        return 0
    positions = math.prod(int(d) for d in out[1:-1]) if len(out) > 2 else 1
    if isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
        return 2 * (_size(layer.depthwise_kernel) + _size(layer.pointwise_kernel)) * positions
    if isinstance(layer, L.MultiHeadAttention):
        t = int(out[1])
        projections = sum(_size(w) for w in layer.trainable_weights if len(w.shape) == 3)
        return 2 * t * projections + 4 * t * t * layer.num_heads * layer.key_dim
    if isinstance(layer, (L.LSTM, L.GRU, L.SimpleRNN)):
        steps = int(layer.input.shape[1])
        cell = layer.cell
        return 2 * steps * (_size(cell.kernel) + _size(cell.recurrent_kernel))
    kernel = getattr(layer, "kernel", None)
    if kernel is not None and len(kernel.shape) >= 2:
        return 2 * _size(kernel) * positions
    return 0

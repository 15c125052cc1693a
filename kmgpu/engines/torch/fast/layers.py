"""Keras layers and ops on torch's fused kernels: BatchNormalization, Dense and
the sparse categorical cross-entropy from logits (the last two: ``dense_call`` and
``sparse_categorical_crossentropy`` below, with their own switches).

Keras 3.15.1's ``BatchNormalization.call`` on torch is a chain of separate ops: the
moments (two means, a square, a subtraction), the normalisation (subtract, add, rsqrt,
two multiplies, add), the two moving-average updates, and autograd's backward of each:
dozens of kernels per layer per training step, a large share of a BatchNorm-heavy
network's GPU time, where torch's own batch norm is one kernel each way.
``batch_norm_call`` computes the same layer with torch's batch norm:

- the channel axis is moved to dimension 1 as a view (a ``channels_last`` Keras tensor
  is then torch's channels_last memory format: no copy);
- training: the kernel computes the batch statistics once, for the normalisation and into
  zeroed running buffers at torch momentum 1 (the batch's mean and its unbiased variance,
  scaled back to Keras's biased one by (n-1)/n); Keras's moving averages
  ``moving * momentum + batch * (1 - momentum)`` are then one ``lerp`` each, ``assign``-ed
  to Keras's variables (so a stateless scope and save/load see Keras's own variables).
  (letting the kernel update copies of the moving statistics, scaled by n/(n-1) before
  and back after, would leave 2 more roundings on them than Keras's formula);
- inference uses the moving statistics, like Keras;
- float16/bfloat16 inputs are computed in float32 and cast back, as Keras does;
- the kernel (``kernel``): on CUDA torch's own batch-norm kernels
  (``torch.native_batch_norm``: Welford's method in float32, tree reductions), not the
  cuDNN one ``F.batch_norm`` picks, in cuDNN's persistent mode for channels-last training
  (``benchmarks/lab/torch_bn_parity.py`` measures both against float64 and for speed). On a
  CPU ``F.batch_norm`` on a copy that holds each channel's values together: torch's CPU
  kernel adds a channels-last or (batch, features) input row by row, in sequence, 3-10x
  farther from float64 than Keras's layer; a channel's contiguous values it sums pairwise.

Against float64 (``reference_call``) this layer is as close as Keras's or closer on a CPU
(``tests/torch/test_fused_bn_precision.py``): torch computes the variance with Welford's
method or two passes where Keras uses E[x^2] - E[x]^2 in float32, which loses digits when
a channel's mean is large against its spread. What it does not cover runs Keras's own
``call`` (``fallback``): a mask, ``renorm``, ``synchronized=True``, moments replaced on
the layer (kmgpu's ``sync_batchnorm``: ``layer_fixes.global_batch_moments``), a batch of
one value per channel, integer inputs, symbolic (meta) tensors. Nothing here is
installed: ``fast_fixes`` decides that.

``reference_call`` is the yardstick of the tests and ``benchmarks/lab/torch_bn_parity.py``:
the layer in float64. Keras's own layer cannot be: Keras 3.15.1 computes
BatchNormalization in float32 even in a float64 model (``backend.result_type`` turns
float64 into float32 on torch and JAX), so a "float64" Keras run shares Keras's float32
BatchNorm arithmetic, and measured against it Keras's float32 layer looks closer than it
is.
"""

import torch
import torch.nn.functional as F

from kmgpu import environment
from kmgpu.engines.torch.fast import rnn as fast_rnn


def why_not(layer, inputs, training=None, mask=None):
    """Why ``batch_norm_call`` hands this call to Keras's own code (None: it does not)."""
    if mask is not None:
        return "a mask"
    if getattr(layer, "renorm", False):
        return "renorm=True"
    if getattr(layer, "synchronized", False):
        return "synchronized=True"
    if "_moments" in vars(layer):  # kmgpu's sync_batchnorm (layer_fixes.global_batch_moments)
        return "its moments are replaced (global-batch moments)"
    if not torch.is_tensor(inputs) or inputs.device.type == "meta":
        return "symbolic inputs"
    if not torch.is_floating_point(inputs):
        return f"{inputs.dtype} inputs"
    axis = layer.axis if isinstance(layer.axis, int) else None
    if axis is None or inputs.dim() < 2:
        return "a channel axis torch's batch norm cannot take"
    if training and layer.trainable and inputs.numel() <= inputs.shape[axis]:
        return "one value per channel in the batch"
    return None


def batch_norm_call(layer, inputs, training=None, mask=None, *, fallback):
    """``BatchNormalization.call`` on torch's fused batch norm (see the module);
    ``fallback(layer, inputs, training=..., mask=...)`` is Keras's own call."""
    if why_not(layer, inputs, training, mask) is not None:
        return fallback(layer, inputs, training=training, mask=mask)
    x = inputs
    compute = torch.promote_types(x.dtype, torch.float32)
    x = x.to(compute)
    axis = layer.axis % x.dim()
    xt = x if axis == 1 else x.movedim(axis, 1)
    gamma = layer.gamma.value.to(compute) if layer.scale else None
    beta = layer.beta.value.to(compute) if layer.center else None
    mean = layer.moving_mean.value.to(compute)
    var = layer.moving_variance.value.to(compute)
    if training and layer.trainable:
        n = x.numel() // x.shape[axis]
        with torch.no_grad():  # the kernel's running buffers, momentum 1: the batch's
            batch = torch.zeros((2,) + mean.shape, dtype=compute, device=x.device)
        out = kernel(xt, gamma, beta, batch[0], batch[1], True, 1.0, layer.epsilon)
        with torch.no_grad():
            m = 1.0 - layer.momentum
            layer.moving_mean.assign(mean.lerp(batch[0], m))
            layer.moving_variance.assign(var.lerp(batch[1] * ((n - 1) / n), m))
    else:
        out = kernel(xt, gamma, beta, mean, var, False, 0.0, layer.epsilon)
    if axis != 1:
        out = out.movedim(1, axis)
    return out.to(getattr(torch, layer.compute_dtype))


def kernel(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """torch's batch norm of ``x`` (channels on dimension 1), the kernel chosen for
    precision (see the module): on CUDA torch's own kernels, whatever the memory format;
    elsewhere ``F.batch_norm`` on a copy that holds each channel's values together.

    One affine tensor without the other (``scale=False``: InceptionV3's every layer; or
    ``center=False``) is given both, the missing one as ones or zeros: on CUDA, torch
    2.11's batch-norm backward then returns an empty gradient for the one it has
    ("NativeBatchNormBackward0 returned an invalid gradient at index 2"). Multiplying by
    one and adding zero change no value."""
    if (weight is None) != (bias is None):
        weight = torch.ones_like(bias) if weight is None else weight
        bias = torch.zeros_like(weight) if bias is None else bias
    if x.device.type == "cuda" and CUDA_KERNEL == "native":
        return torch.native_batch_norm(x, weight, bias, running_mean, running_var, training,
                                       momentum, eps)[0]
    if x.device.type != "cuda":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif CUDA_KERNEL == "nchw":
        x = x.contiguous()
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


# The CUDA kernel: "native" (torch's, the default), or, for benchmarks/lab/torch_bn_parity.py's
# comparison, "cudnn" (F.batch_norm as it comes: cuDNN, persistent mode for channels-last
# training) and "nchw" (F.batch_norm on a contiguous NCHW copy: cuDNN's ordinary mode).
CUDA_KERNEL = "native"


def reference_call(layer, inputs, training=None, mask=None):
    """``BatchNormalization.call`` in float64, the measure's yardstick (see the module):
    two-pass batch moments, Keras's moving averages and normalisation, cast to the
    layer's compute dtype. No mask, no renorm."""
    assert mask is None and not getattr(layer, "renorm", False)
    x = inputs.to(torch.float64)
    axes = [a for a in range(x.dim()) if a != layer.axis % x.dim()]
    shape = [1 if a in axes else -1 for a in range(x.dim())]
    mean = layer.moving_mean.value.to(torch.float64)
    var = layer.moving_variance.value.to(torch.float64)
    if training and layer.trainable:
        batch_mean = x.mean(axes)
        batch_var = (x - batch_mean.reshape(shape)).square().mean(axes)
        m = layer.momentum
        layer.moving_mean.assign(mean * m + batch_mean.detach() * (1 - m))
        layer.moving_variance.assign(var * m + batch_var.detach() * (1 - m))
        mean, var = batch_mean, batch_var
    out = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + layer.epsilon)
    if layer.scale:
        out = out * layer.gamma.value.to(torch.float64).reshape(shape)
    if layer.center:
        out = out + layer.beta.value.to(torch.float64).reshape(shape)
    return out.to(getattr(torch, layer.compute_dtype))


def batch_norm_method(original):
    """A ``BatchNormalization.call`` (Keras's signature, which Keras reads) that runs
    ``batch_norm_call`` and falls back to ``original`` (Keras's own call)."""

    def call(self, inputs, training=None, mask=None):
        return batch_norm_call(self, inputs, training, mask, fallback=original)

    call.__doc__ = original.__doc__
    call.__wrapped_by_kmgpu__ = original
    return call


def describe_ops(model, on_gpu):
    """describe()'s words for the Dense, EinsumDense and sparse cross-entropy paths inside
    kmgpu's steps ("" off a GPU, or when ``model`` has none)."""
    import keras

    words = ""
    for kind, which, switch in ((keras.layers.Dense, "Dense", "dense"),
                                (keras.layers.EinsumDense, "EinsumDense", "einsum")):
        if on_gpu and any(isinstance(layer, kind) for layer in model._flatten_layers()):
            name = SWITCHES[switch]
            words += (f"; {which} through F.linear (the bias in the matmul) inside these steps "
                      f"({name}=0: Keras's own)" if fast_op_enabled(switch)
                      else f"; {which}: Keras's own call ({name}=0)")
    if on_gpu and _sparse_ce_from_logits(model):
        words += ("; SparseCategoricalCrossentropy(from_logits=True) over a contiguous "
                  "(rows, classes) view inside these steps (KMGPU_TORCH_FAST_LOSS=0: Keras's "
                  "own)" if fast_op_enabled("loss") else
                  "; SparseCategoricalCrossentropy: Keras's own (KMGPU_TORCH_FAST_LOSS=0)")
    if on_gpu and any(isinstance(layer, _spatial()) for layer in model._flatten_layers()):
        words += ("; convolutions and poolings without Keras's two copies of each input "
                  "inside these steps (KMGPU_TORCH_FAST_CONV=0: Keras's own)"
                  if fast_op_enabled("conv") else
                  "; convolutions: Keras's own (KMGPU_TORCH_FAST_CONV=0)")
    return words + fast_rnn.describe(model, on_gpu, fast_op_enabled("rnn"))


def _spatial():
    import keras

    L = keras.layers
    return (L.Conv2D, L.Conv3D, L.Conv2DTranspose, L.Conv3DTranspose, L.DepthwiseConv2D,
            L.SeparableConv2D, L.MaxPooling2D, L.MaxPooling3D, L.AveragePooling2D,
            L.AveragePooling3D)


def _sparse_ce_from_logits(model):
    import keras

    for loss in keras.tree.flatten(getattr(model, "loss", None) or []):
        if isinstance(loss, keras.losses.SparseCategoricalCrossentropy) and \
                loss.get_config().get("from_logits"):
            return True
    return False


def describe(model, on_gpu):
    """describe()'s words for the BatchNormalization path inside kmgpu's steps ("" when
    ``model`` has no such layer)."""
    import keras

    if not any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers()):
        return ""
    if on_gpu and enabled():
        return ("; BatchNormalization on torch's fused batch-norm kernel inside these steps "
                "(KMGPU_TORCH_FUSED_BN=0: Keras's own layer)")
    if on_gpu:
        return "; BatchNormalization: Keras's own layer (KMGPU_TORCH_FUSED_BN=0)"
    return ""


def enabled():
    """Whether kmgpu's steps on CUDA run BatchNormalization fused
    (``fast_fixes.fused_batchnorm``): unless ``KMGPU_TORCH_FUSED_BN=0``."""
    return environment.enabled("KMGPU_TORCH_FUSED_BN")


# -- Dense and the sparse cross-entropy (the transformer's vocabulary-sized logits) -------
def sparse_ce_why_not(target, output, from_logits, axis):
    """Why ``sparse_categorical_crossentropy`` hands this call to Keras's (None: it does not)."""
    if not from_logits:
        return "probabilities (from_logits=False)"
    if not (torch.is_tensor(output) and torch.is_tensor(target)):
        return "not torch tensors"
    if output.device.type == "meta" or not torch.is_floating_point(output):
        return "symbolic or integer outputs"
    if output.dim() < 3:
        return "a class axis already at position 1"
    if axis % output.dim() != output.dim() - 1:
        return "a class axis other than the last"
    shape = list(target.shape)
    if len(shape) == output.dim() and shape[-1] == 1:
        shape = shape[:-1]
    if shape != list(output.shape[:-1]):
        return "a target of another shape (Keras's error)"
    return None


def sparse_categorical_crossentropy(target, output, from_logits=False, axis=-1, *, fallback):
    """Keras's torch ``sparse_categorical_crossentropy`` (``fallback``) for logits whose
    class axis is the last of three or more: ``F.cross_entropy`` over the contiguous
    ``(rows, classes)`` view, the per-element losses reshaped back. Keras 3.15.1 moves the
    class axis to position 1 instead (``movedim``): for (batch, seq, classes) logits a
    strided tensor that torch copies contiguous and runs its spatial log-softmax and
    ``nll_loss2d`` kernels over, forward and backward. The same losses (one log-softmax
    per row either way)."""
    if sparse_ce_why_not(target, output, from_logits, axis) is not None:
        return fallback(target, output, from_logits=from_logits, axis=axis)
    shape = output.shape[:-1]
    rows = F.cross_entropy(output.reshape(-1, output.shape[-1]),
                           target.reshape(-1).to(device=output.device, dtype=torch.long),
                           reduction="none")
    return rows.reshape(shape)


def dense_why_not(layer, inputs, rank=2):
    """Why ``dense_call`` (``fast.einsum.call``: its inputs of at least ``rank`` axes) hands
    this call to Keras's own (None: it does not)."""
    if getattr(layer, "quantization_mode", None) is not None:
        return "a quantized layer"
    if layer.bias is None:
        return "no bias (nothing to fuse)"
    if not torch.is_tensor(inputs) or inputs.device.type == "meta" or inputs.dim() < rank:
        return f"symbolic inputs, or fewer than {rank} axes"
    if inputs.dtype not in (torch.float32, torch.bfloat16, torch.float64) and not (
            inputs.dtype == torch.float16 and inputs.device.type == "cuda"):
        return f"{inputs.dtype} inputs"  # Keras's matmul casts these
    return None


def linear_weights(layer, dtype):
    """The layer's kernel and bias as Keras's call reads them (autocast, LoRA), or None
    where either is not of ``dtype`` (the inputs')."""
    import keras

    kernel = keras.ops.convert_to_tensor(layer.kernel)
    bias = keras.ops.convert_to_tensor(layer.bias)
    return None if kernel.dtype != dtype or bias.dtype != dtype else (kernel, bias)


def dense_call(layer, inputs, training=None, *, fallback):
    """``Dense.call`` with the bias in the matmul: ``F.linear`` (addmm: cuBLAS adds the
    bias in its epilogue) where Keras 3.15.1 runs ``matmul`` and then a separate ``add``
    over the whole output; the activation after, as Keras. Kernel and bias are read as
    Keras reads them (autocast, LoRA); other dtypes than the inputs' go to ``fallback``."""
    weights = None if dense_why_not(layer, inputs) else linear_weights(layer, inputs.dtype)
    if weights is None:
        return fallback(layer, inputs, training=training)
    kernel, bias = weights
    x = F.linear(inputs, kernel.t(), bias)
    return x if layer.activation is None else layer.activation(x)


def dense_method(original):
    """A ``Dense.call`` (Keras's signature) that runs ``dense_call``, falling back to
    ``original`` (Keras's own call)."""
    return layer_method(original, dense_call)


def layer_method(original, fast_call):
    """A layer's ``call(inputs, training=None)`` that runs ``fast_call``, falling back to
    ``original`` (Keras's own call)."""

    def call(self, inputs, training=None):
        return fast_call(self, inputs, training, fallback=original)

    call.__doc__ = original.__doc__
    call.__wrapped_by_kmgpu__ = original
    return call


def loss_function(original):
    """A ``sparse_categorical_crossentropy`` (Keras's torch backend's signature) that runs
    this module's, falling back to ``original``."""

    def sparse_ce(target, output, from_logits=False, axis=-1):
        return sparse_categorical_crossentropy(target, output, from_logits, axis,
                                               fallback=original)

    sparse_ce.__doc__ = original.__doc__
    sparse_ce.__wrapped_by_kmgpu__ = original
    return sparse_ce


SWITCHES = {"dense": "KMGPU_TORCH_FAST_DENSE", "einsum": "KMGPU_TORCH_FAST_EINSUM",
            "loss": "KMGPU_TORCH_FAST_LOSS",
            "conv": "KMGPU_TORCH_FAST_CONV", "rnn": "KMGPU_TORCH_FAST_RNN"}


def fast_op_enabled(which):
    """Whether kmgpu's steps on CUDA run ``which`` ("dense", "loss"; "einsum":
    ``fast.einsum``; "conv": ``fast.conv``; "rnn": ``fast.rnn``) on the fast path: unless
    its switch (``SWITCHES``) is "0"."""
    return environment.enabled(SWITCHES[which])

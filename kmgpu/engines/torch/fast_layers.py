"""Keras layers on torch's fused kernels (issue 31): BatchNormalization first.

Keras 3.15.1's ``BatchNormalization.call`` on torch is a chain of separate ops: the
moments (two means, a square, a subtraction), the normalisation (subtract, add, rsqrt,
two multiplies, add), the two moving-average updates, and autograd's backward of each:
about 48 kernels per layer per training step on an H200, 55 % of ResNet-50's GPU time
(``benchmarks/results/torch-kernels-h200.md``), where torch's own batch norm is one
cuDNN (or native) kernel each way. ``batch_norm_call`` computes the same layer with
``torch.nn.functional.batch_norm``:

- the channel axis is moved to dimension 1 as a view (a ``channels_last`` Keras tensor
  is then torch's channels_last memory format: no copy);
- training: the batch statistics and the moving averages come from the same kernel.
  Keras's moving averages are ``moving * momentum + batch * (1 - momentum)`` with the
  biased batch variance; torch's kernel updates running buffers with its momentum
  ``1 - momentum`` and the unbiased variance, so it updates copies (the variance one
  scaled by (n-1)/n first and n/(n-1) after) that are then ``assign``-ed to Keras's
  variables (so a stateless scope and save/load see Keras's own variables);
- inference uses the moving statistics, like Keras;
- float16/bfloat16 inputs are computed in float32 and cast back, as Keras does.

The numbers differ from Keras's only by float rounding: torch computes the variance in one
pass with Welford's method where Keras uses E[x^2] - E[x]^2 (torch's is the more
accurate). What it does not cover runs Keras's own ``call`` (``fallback``): a mask,
``renorm``, ``synchronized=True``, moments replaced on the layer (kmgpu's
``sync_batchnorm``: ``keras_fixes.global_batch_moments``), a batch of one value per channel, integer inputs,
symbolic (meta) tensors. Nothing here is installed: ``keras_fixes`` decides that.
"""

import torch
import torch.nn.functional as F


def why_not(layer, inputs, training=None, mask=None):
    """Why ``batch_norm_call`` hands this call to Keras's own code (None: it does not)."""
    if mask is not None:
        return "a mask"
    if getattr(layer, "renorm", False):
        return "renorm=True"
    if getattr(layer, "synchronized", False):
        return "synchronized=True"
    if "_moments" in vars(layer):  # kmgpu's sync_batchnorm (keras_fixes.global_batch_moments)
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
        with torch.no_grad():
            running_mean = mean.detach().clone()
            running_var = var.detach() * (n / (n - 1))
        out = F.batch_norm(xt, running_mean, running_var, gamma, beta, training=True,
                           momentum=1.0 - layer.momentum, eps=layer.epsilon)
        with torch.no_grad():
            layer.moving_mean.assign(running_mean)
            layer.moving_variance.assign(running_var * ((n - 1) / n))
    else:
        out = F.batch_norm(xt, mean, var, gamma, beta, training=False, eps=layer.epsilon)
    if axis != 1:
        out = out.movedim(1, axis)
    return out.to(getattr(torch, layer.compute_dtype))


def batch_norm_method(original):
    """A ``BatchNormalization.call`` (Keras's signature, which Keras reads) that runs
    ``batch_norm_call`` and falls back to ``original`` (Keras's own call)."""

    def call(self, inputs, training=None, mask=None):
        return batch_norm_call(self, inputs, training, mask, fallback=original)

    call.__doc__ = original.__doc__
    call.__wrapped_by_kmgpu__ = original
    return call

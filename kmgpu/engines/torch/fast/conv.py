"""Keras's torch convolutions and poolings without the two layout copies of their input,
inside kmgpu's steps on CUDA (``fast_fixes``: switch
``KMGPU_TORCH_FAST_CONV``, "0" keeps Keras's).

Keras 3.15.1 (``keras/src/backend/torch/nn.py``) moves a ``channels_last`` input's channel
axis to position 1 with ``permute`` followed by ``.contiguous()`` (``_transpose_spatial_inputs``):
a copy of the whole activation into NCHW. ``conv`` then converts that copy to torch's
``channels_last`` memory format for cuDNN (``_maybe_convert_to_channels_last``): a second
copy, back into the layout the activation had to begin with. The permuted view of a
contiguous NHWC tensor already *is* torch's channels_last format, so ``spatial_inputs``
returns it uncopied: the convolution sees the same values in the same memory format (cuDNN
runs the same kernels on them), the poolings torch's channels-last kernels. Each copy is a
strided kernel per convolution, a measurable share of a convolutional network's step on a
GPU.
"""

import torch


def why_not(inputs):
    """Why ``spatial_inputs`` hands this tensor to Keras's own function (None: it does not)."""
    if not torch.is_tensor(inputs):
        return "not a torch tensor"
    if inputs.ndim not in (4, 5):
        return "a 1-D input (torch has no channels-last format for it)"
    if inputs.device.type == "meta":
        return "a symbolic (meta) tensor"
    return None


def spatial_inputs(inputs, *, fallback):
    """Keras's ``_transpose_spatial_inputs`` (``fallback``) without its ``.contiguous()``:
    the ``(batch, channels, *spatial)`` view of a channels-last input."""
    if why_not(inputs) is not None:
        return fallback(inputs)
    return inputs.permute((0, inputs.ndim - 1) + tuple(range(1, inputs.ndim - 1)))


def transpose_function(original):
    """A ``_transpose_spatial_inputs`` (Keras's signature) that runs ``spatial_inputs``,
    falling back to ``original``."""

    def transpose(inputs):
        return spatial_inputs(inputs, fallback=original)

    transpose.__doc__ = original.__doc__
    transpose.__wrapped_by_kmgpu__ = original
    return transpose

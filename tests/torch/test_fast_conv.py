"""Keras's torch convolutions and poolings without the two copies of their input
(engines/torch/fast/conv.py, swapped in by fast_fixes.fast_ops inside kmgpu's steps on
CUDA; made to swap on a CPU here) against Keras's own: each layer kind's outputs and
gradients, that the convolution gets the input's own memory (no copy), what stays Keras's,
and a 2-epoch fit of a small CNN through kmgpu's split step against plain Keras."""

import keras
import numpy as np
import pytest
import torch
from keras.src.backend.torch import nn as keras_nn  # the module whose function is swapped

from kmgpu.engines.torch import fast_fixes
from kmgpu.engines.torch.fast import conv as fast_conv, layers as fast_layers
from tests.helpers import rel_diff
from tests.torch.fast_paths import fit

L = keras.layers


@pytest.fixture
def swap_on(monkeypatch):
    """fast_ops swaps on this CPU; counts the inputs fast_conv took (not its fallback)."""
    taken = [0]
    original = fast_conv.spatial_inputs

    def counted(inputs, *, fallback):
        taken[0] += fast_conv.why_not(inputs) is None
        return original(inputs, fallback=fallback)

    monkeypatch.setattr(fast_conv, "spatial_inputs", counted)
    monkeypatch.setattr(fast_fixes, "on_cuda", lambda device: True)
    for name in fast_layers.SWITCHES.values():
        monkeypatch.delenv(name, raising=False)
    return taken


LAYERS = {
    "conv2d_same": (lambda: L.Conv2D(6, 3, padding="same"), (2, 9, 9, 4)),
    "conv2d_stride2_same": (lambda: L.Conv2D(6, 3, strides=2, padding="same"), (2, 9, 9, 4)),
    "conv2d_dilated": (lambda: L.Conv2D(5, 3, dilation_rate=2), (2, 9, 9, 4)),
    "depthwise": (lambda: L.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
                  (2, 8, 8, 4)),
    "separable": (lambda: L.SeparableConv2D(5, 3, strides=2, padding="same"), (2, 8, 8, 4)),
    "conv3d": (lambda: L.Conv3D(3, 2), (2, 4, 5, 5, 3)),
    "conv2d_transpose": (lambda: L.Conv2DTranspose(3, 3, strides=2), (2, 5, 5, 4)),
    "maxpool_same": (lambda: L.MaxPooling2D(3, strides=2, padding="same"), (2, 9, 9, 4)),
    "avgpool_same": (lambda: L.AveragePooling2D(3, strides=2, padding="same"), (2, 9, 9, 4)),
    "conv1d": (lambda: L.Conv1D(4, 3), (2, 9, 4)),
}


def _out_and_grads(layer, x):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    weights = [w.value for w in layer.trainable_weights]
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(),
                                [x] + weights)
    return [out.detach()] + [g.detach() for g in grads]


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_layer_equals_kerass(swap_on, case):
    """Each layer kind inside the swap against outside it: outputs and the gradients of the
    input and of every weight to float32 rounding; the fast path taken for 2-D and 3-D
    inputs, Keras's code for 1-D."""
    make, shape = LAYERS[case]
    keras.utils.set_random_seed(3)
    layer = make()
    x = torch.as_tensor(np.random.default_rng(1).normal(size=shape).astype("float32"))
    layer(x)
    ref = _out_and_grads(layer, x)
    with fast_fixes.fast_ops("cuda:0"):
        got = _out_and_grads(layer, x)
    assert (swap_on[0] > 0) == (case != "conv1d"), swap_on
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert float((a - b).abs().max() / a.abs().max().clamp_min(1e-6)) <= 1e-6


def test_convolution_reads_the_inputs_memory(swap_on, monkeypatch):
    """The tensor Keras hands to torch's conv2d is the layer's input itself, permuted (same
    storage, channels_last strides): Keras's own code hands it a copy."""
    seen = []
    conv2d = keras_nn.tnn.conv2d

    def spy(inputs, *a, **k):
        seen.append((inputs.data_ptr(), inputs.is_contiguous(memory_format=torch.channels_last)))
        return conv2d(inputs, *a, **k)

    monkeypatch.setattr(keras_nn.tnn, "conv2d", spy)
    layer = L.Conv2D(6, 3)
    x = torch.randn(2, 7, 7, 4)
    layer(x)
    seen.clear()
    layer(x)
    assert seen == [(seen[0][0], True)] and seen[0][0] != x.data_ptr()
    seen.clear()
    with fast_fixes.fast_ops("cuda:0"):
        layer(x)
    assert seen == [(x.data_ptr(), True)]


def _cnn():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((10, 10, 3)), L.Conv2D(8, 3, padding="same", use_bias=False),
        L.BatchNormalization(),
        L.ReLU(), L.MaxPooling2D(2), L.DepthwiseConv2D(3, padding="same"),
        L.Conv2D(8, 1, strides=2), L.GlobalAveragePooling2D(), L.Dense(3)])


def _fit(parallel):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(48, 10, 10, 3)).astype("float32")
    model = _cnn()
    losses = fit(model, x, rng.integers(0, 3, 48), parallel,
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, losses


def test_fit_through_kmgpus_step_equals_plain_keras(swap_on):
    """A small CNN (convolution, BatchNorm, pooling, depthwise, strided 1x1), 2 epochs (no
    bias before the BatchNorm: its gradient is rounding noise, which Adam turns into steps):
    kmgpu's split step with the swap in (every convolution and pooling took it) against
    plain Keras: weights and losses."""
    ref, ref_loss = _fit(False)
    assert swap_on == [0]
    model, loss = _fit(True)
    assert swap_on[0] >= 12 * 4, swap_on
    assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5
    assert np.allclose(ref_loss, loss, rtol=1e-5, atol=0)


def test_switch_and_describe(swap_on, monkeypatch):
    """KMGPU_TORCH_FAST_CONV=0 keeps Keras's function inside the block; Keras's is back after
    it; describe() names the path on a GPU only."""
    keras_fn = keras_nn._transpose_spatial_inputs
    model = _cnn()
    assert "without Keras's two copies" in fast_layers.describe_ops(model, on_gpu=True)
    assert fast_layers.describe_ops(model, on_gpu=False) == ""
    with fast_fixes.fast_ops("cuda:0"):
        assert keras_nn._transpose_spatial_inputs.__wrapped_by_kmgpu__ is keras_fn
    assert keras_nn._transpose_spatial_inputs is keras_fn
    monkeypatch.setenv("KMGPU_TORCH_FAST_CONV", "0")
    with fast_fixes.fast_ops("cuda:0"):
        assert keras_nn._transpose_spatial_inputs is keras_fn
    assert "convolutions: Keras's own" in fast_layers.describe_ops(model, on_gpu=True)

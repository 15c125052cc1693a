"""Keras's torch layers and ops swapped for faster equal ones while kmgpu's step runs on
CUDA: BatchNormalization on torch's fused kernel (``fused_batchnorm``), and Dense and
EinsumDense, the sparse cross-entropy, convolution inputs and masked GRU/LSTM (``fast_ops``:
``fast.layers``, ``fast.einsum``, ``fast.conv``, ``fast.rnn``). Rows of
``kmgpu/engines/torch/keras_fixes.py``.
"""

import contextlib

import torch

from kmgpu.engines import keras_fixes
from kmgpu.engines.torch.fast import (conv as fast_conv, einsum as fast_einsum,
                                      layers as fast_layers, rnn as fast_rnn)


def fused_batchnorm(device):
    """Within the block, on a CUDA ``device``, Keras's ``BatchNormalization`` runs on
    torch's fused batch norm (``fast_layers``: torch's native kernel, one each way instead
    of dozens per layer: measurably faster on a GPU, see docs/backends.md), as close to a
    float64 layer as Keras's own or closer (benchmarks/lab/torch_bn_parity.py).
    ``KMGPU_TORCH_FUSED_BN=0`` keeps Keras's layer. Elsewhere Keras's own call.
    Re-entrant."""
    from keras.src.layers.normalization import batch_normalization

    if not (fast_layers.enabled() and torch.device(device).type == "cuda"):
        return contextlib.nullcontext()
    return keras_fixes.swapped((batch_normalization.BatchNormalization, "call",
                                fast_layers.batch_norm_method))


def _fast_swaps():
    """(owner, name, make) of each of ``fast_ops``' swaps whose switch is on."""
    from keras.src.backend.torch import nn
    from keras.src.layers.core import dense, einsum_dense
    from keras.src.layers.rnn import gru, lstm

    return [(owner, name, make) for which, owner, name, make in (
            ("loss", nn, "sparse_categorical_crossentropy", fast_layers.loss_function),
            ("dense", dense.Dense, "call", fast_layers.dense_method),
            ("einsum", einsum_dense.EinsumDense, "call", fast_einsum.method),
            ("conv", nn, "_transpose_spatial_inputs", fast_conv.transpose_function),
            ("rnn", gru.GRU, "inner_loop", lambda f: fast_rnn.inner_loop_method(f, "gru")),
            ("rnn", lstm.LSTM, "inner_loop", lambda f: fast_rnn.inner_loop_method(f, "lstm")))
            if fast_layers.fast_op_enabled(which)]


def fast_ops(device):
    """Within the block, on a CUDA ``device``, Keras's ``Dense.call`` and ``EinsumDense.call``
    (where its equation is a Dense over flattened axes, ``fast.einsum``) run ``F.linear``,
    its torch ``sparse_categorical_crossentropy`` over a contiguous (rows, classes) view
    (``fast_layers``), convolutions and poolings read a channels_last input uncopied
    (``fast_conv``), and a masked GRU/LSTM runs cuDNN over the compacted sequence
    (``fast_rnn``); each has its switch (``fast_layers.SWITCHES``: "0" keeps Keras's).
    Each is measurably faster on a GPU (see docs/backends.md). Elsewhere Keras's own.
    Re-entrant."""
    return keras_fixes.swapped(*_fast_swaps()) if on_cuda(device) else contextlib.nullcontext()


def on_cuda(device):
    """Whether ``fast_ops(device)`` swaps (tests make it True on a CPU)."""
    return torch.device(device).type == "cuda"

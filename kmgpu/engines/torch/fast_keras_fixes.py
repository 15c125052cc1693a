"""Keras internals swapped for ``fast_layers``' Dense and sparse cross-entropy,
``fast_conv``'s convolution inputs and ``fast_rnn``'s masked GRU/LSTM while kmgpu's step runs
on CUDA (apart from ``graph_keras_fixes`` by role, which keeps the BatchNormalization
swap).
``keras_fixes.PATCHES`` includes these rows, so ``tests/unit/test_structure.py`` checks them.
"""

import contextlib

import torch

from kmgpu.engines.torch import fast_conv, fast_layers, fast_rnn
from kmgpu.engines.torch.graph_keras_fixes import _Swap

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.torch.nn", "sparse_categorical_crossentropy",
     "swapped while kmgpu's step runs on a CUDA device (fast_ops; KMGPU_TORCH_FAST_LOSS=0 "
     "keeps Keras's): Keras 3.15.1 moves the class axis to position 1 (movedim) before "
     "F.cross_entropy, so (batch, seq, classes) logits reach torch as a strided tensor it "
     "copies contiguous and runs its spatial log-softmax / nll_loss2d kernels over, forward "
     "and backward (a large share of a transformer's step on a GPU); fast_layers takes "
     "F.cross_entropy over the contiguous (rows, classes) view: the same losses, measurably "
     "faster (Keras's code for what it does not cover: probabilities, a class axis not "
     "last, rank 2)"),
    ("keras.src.layers.core.dense", "Dense.call",
     "swapped likewise (KMGPU_TORCH_FAST_DENSE=0 keeps Keras's): Keras 3.15.1 runs matmul "
     "then a separate add of the bias over the whole output; fast_layers.dense_call runs "
     "F.linear (addmm, the bias in cuBLAS's epilogue), then the activation: the same values "
     "up to float32 rounding, one kernel fewer per layer (Keras's call for quantized "
     "layers, no bias, other dtypes)"),
    ("keras.src.backend.torch.nn", "_transpose_spatial_inputs",
     "swapped likewise (KMGPU_TORCH_FAST_CONV=0 keeps Keras's): Keras 3.15.1 moves a "
     "channels_last input's channel axis with permute + .contiguous() (a copy into NCHW) "
     "before every convolution and pooling, and conv then copies that back into torch's "
     "channels_last format for cuDNN; fast_conv.spatial_inputs returns the permuted view, "
     "which already is channels_last: the same values and memory format at the convolution, "
     "two activation copies fewer per convolution (Keras's function for 1-D and meta inputs)"),
    ("keras.src.layers.rnn.gru", "GRU.inner_loop",
     "swapped likewise (KMGPU_TORCH_FAST_RNN=0 keeps Keras's): Keras 3.15.1's torch gru() "
     "raises NotImplementedError for any mask, so a masked GRU runs the generic rnn() "
     "loop, one Python iteration and a dozen kernels per timestep (thousands of kernels per "
     "step for a bidirectional GRU over 128 steps); fast_rnn moves each row's valid "
     "steps to the front on the device (cumsum, gather: no host read, capturable) and "
     "runs the unmasked cuDNN GRU Keras runs without a mask, then maps back: the generic "
     "loop's outputs, states and last_output for any mask, in a few hundred kernels "
     "(Keras's code for what it does not cover: fast_rnn.why_not)"),
    ("keras.src.layers.rnn.lstm", "LSTM.inner_loop",
     "swapped likewise: Keras 3.15.1's torch lstm() raises NotImplementedError for any "
     "mask (the generic per-timestep loop); fast_rnn runs the compacted sequence through "
     "the cuDNN LSTM where the layer discards its final states (the cell state at a row's "
     "last valid step is not among cuDNN's outputs: return_state and stateful keep "
     "Keras's loop)"),
]


def _swap(use):
    from keras.src.backend.torch import nn
    from keras.src.layers.core import dense
    from keras.src.layers.rnn import gru, lstm

    for which, owner, name, make in (
            ("loss", nn, "sparse_categorical_crossentropy", fast_layers.loss_function),
            ("dense", dense.Dense, "call", fast_layers.dense_method),
            ("conv", nn, "_transpose_spatial_inputs", fast_conv.transpose_function),
            ("rnn", gru.GRU, "inner_loop", lambda f: fast_rnn.inner_loop_method(f, "gru")),
            ("rnn", lstm.LSTM, "inner_loop", lambda f: fast_rnn.inner_loop_method(f, "lstm"))):
        current = getattr(owner, name)
        keras_fn = getattr(current, "__wrapped_by_kmgpu__", current)
        on = use and fast_layers.fast_op_enabled(which)
        setattr(owner, name, make(keras_fn) if on else keras_fn)


_FAST_OPS = _Swap(lambda: _swap(True), lambda: _swap(False))


def fast_ops(device):
    """Within the block, on a CUDA ``device``, Keras's ``Dense.call`` runs ``F.linear``,
    its torch ``sparse_categorical_crossentropy`` over a contiguous (rows, classes) view
    (``fast_layers``), convolutions and poolings read a channels_last input uncopied
    (``fast_conv``), and a masked GRU/LSTM runs cuDNN over the compacted sequence
    (``fast_rnn``); each has its switch (``fast_layers.SWITCHES``: "0" keeps Keras's).
    Each is measurably faster on a GPU (see docs/backends.md). Elsewhere Keras's own.
    Re-entrant."""
    return _FAST_OPS if on_cuda(device) else contextlib.nullcontext()


def on_cuda(device):
    """Whether ``fast_ops(device)`` swaps (tests make it True on a CPU)."""
    return torch.device(device).type == "cuda"

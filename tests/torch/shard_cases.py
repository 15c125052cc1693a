"""What tests/torch/test_shard.py and test_shard_memory.py share: the tiny model and its
rows, one batch's gradients, the optimizer's variables, the tolerance the shard values
are held to against one device, and a stand-in collective's handle."""

import keras
import numpy as np
import torch

TOL = 1e-5
O = keras.optimizers
ROWS, BATCH = 90, 8
_rng = np.random.default_rng(3)
X = _rng.integers(0, 9, size=(ROWS, 4)).astype("int32")
Y = (X.sum(axis=1, keepdims=True) / 9.0 + 0.1 * _rng.normal(size=(ROWS, 1))).astype("float32")


def tiny(dtype=None):
    """Embedding(9, 3) 27 + Dense(5) 60 (no bias: BatchNorm follows) + BatchNormalization
    10 + Dense(1) 6 = 103 trainable parameters."""
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((4,), dtype="int32"), keras.layers.Embedding(9, 3, dtype=dtype),
        keras.layers.Flatten(dtype=dtype), keras.layers.Dense(5, use_bias=False, dtype=dtype),
        keras.layers.BatchNormalization(dtype=dtype),
        keras.layers.Activation("relu", dtype=dtype), keras.layers.Dense(1, dtype=dtype)])


def opt_state(model):
    """The optimizer's variables, as arrays."""
    return [v.numpy() for v in model.optimizer.variables]


def batch_grads(model, keep=False):
    """The gradient of the mean squared error of the first batch of ``X`` (training):
    arrays, or with ``keep`` the torch tensors autograd returned."""
    x = keras.ops.convert_to_tensor(X[:8])
    loss = keras.ops.mean((model(x, training=True) - keras.ops.convert_to_tensor(Y[:8])) ** 2)
    grads = torch.autograd.grad(loss, [v.value for v in model.trainable_weights])
    return list(grads) if keep else [g.numpy() for g in grads]


class Deferred:
    """A stand-in asynchronous collective's handle: ``out`` holds NaN until ``wait``,
    which writes ``result()`` into it, computed then (so a read of ``out``, or a write
    of the collective's input, before the wait shows), and calls ``on_wait``."""

    def __init__(self, out, result, on_wait=lambda: None):
        self.out, self.result, self.on_wait = out, result, on_wait
        out.fill_(float("nan"))

    def wait(self):
        self.out.copy_(self.result())
        self.on_wait()

"""What the tests of kmgpu's torch fast paths share (test_fast_ops, test_fast_conv,
test_fast_rnn): the relative difference they assert on, and one fit of a model as plain
Keras or through kmgpu's one-device split step (jit_compile=True: the step the fast paths
are swapped into, made to swap on a CPU by the tests' fixtures)."""

import keras
import numpy as np
import torch

import kmgpu
from tests.helpers import few_steps, one_device


def rel(a, b):
    """max |a - b| / max |a| (floor 1e-6), for tensors or arrays."""
    a, b = (np.asarray(t.detach().numpy() if torch.is_tensor(t) else t, np.float64)
            for t in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-6))


def fit(model, x, y, parallel, loss, **kwargs):
    """``model`` trained for 2 epochs at batch 8 with Adam(0.01) (kmgpu on one device when
    ``parallel``); returns the loss per epoch."""
    if parallel:
        with one_device():
            runner = kmgpu.parallelize(model, gpus=1)
    else:
        runner = model
    runner.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=parallel, loss=loss)
    with few_steps() if parallel else np.errstate():
        history = runner.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kwargs)
    return history.history["loss"]

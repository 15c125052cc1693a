"""A masked sequence loss in kmgpu's split step on 2 gloo ranks, with the capture forced on
a CPU and strict (a host read raises, as under CUDA-graph capture): the masked loss's
all-reduce of valid timesteps (``loss_fixes.masked_losses``) runs inside the captured
forward pass, and the weights equal Keras's fit on one device.

Keras's torch LSTM/GRU with a mask always runs its Python loop over a tensor time
counter (``while time < time_steps_t``: a host read per timestep; its cuDNN path refuses
masks), so a masked RNN cannot be captured: kmgpu says so in one line and trains it with
the eager split step, still equal to one device. (The CUDA-graph run:
``benchmarks/lab/torch_masked_capture.py``.)"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, rel_diff
from tests.torch.test_default_step import _close_pools, _strict_capture

ROWS, BATCH, STEPS = 45, 10, 6


def _model(rnn):
    keras.utils.set_random_seed(7)
    middle = (keras.layers.LSTM(3, return_sequences=True) if rnn
              else keras.layers.Dense(3, activation="tanh"))  # keeps the mask
    return keras.Sequential([
        keras.Input((STEPS,), dtype="int32"), keras.layers.Embedding(20, 4, mask_zero=True),
        middle, keras.layers.TimeDistributed(keras.layers.Dense(3))])


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(ROWS, STEPS))
    x[np.arange(STEPS)[None, :] >= rng.integers(1, STEPS + 1, size=ROWS)[:, None]] = 0
    return x.astype("int32"), rng.integers(0, 3, size=(ROWS, STEPS)).astype("int32")


def _compile(runner, jit):
    runner.compile(optimizer=keras.optimizers.SGD(0.5), jit_compile=jit,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("rnn", [False, True], ids=["dense", "lstm"])
def test_masked_loss_in_the_captured_split_step_on_two_ranks(monkeypatch, capsys, rnn):
    x, y = _data()
    reference = _model(rnn)
    _compile(reference, False)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _close_pools()
    try:
        _strict_capture(monkeypatch)  # the forked workers inherit it
        model = _model(rnn)
        parallel = kmgpu.parallelize(model, gpus=2)
        _compile(parallel, True)
        with few_steps():
            parallel.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        out = capsys.readouterr().out
        if rnn:  # Keras's masked RNN loop reads the host: the eager split step
            assert "capturing the train step failed" in out  # graph A never captured
            assert "optimizer and metrics run eagerly" not in out
        else:
            assert "optimizer and metrics run eagerly" in out  # rank 0 captured graph A
            assert "capturing the train step failed" not in out
        assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    finally:
        _close_pools()

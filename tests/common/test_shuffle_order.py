"""A shuffled fit under a global seed reads plain Keras's order on one device.

torch: Keras's trainer shuffles arrays with a ``RandomSampler`` (``shuffle=True``) or a
per-batch ``randperm`` (``"batch"``) on torch's default CPU generator, and a
``PyDataset``'s batches with Python's ``random``; kmgpu's ranks start each call from the
driver's random states and draw the same way (``engines/torch/data/shuffle.py``), and the
driver's states end where plain Keras leaves them. TensorFlow: Keras's array pipeline
reads the same permutation every epoch under a global seed (``data_fixes.
first_pass_order``). Before, both drew their own orders: weights 0.05-0.06 relative from
one device after shuffled fits on 4 devices. JAX runs Keras's own pipeline. The test runs
on 2 devices (the order is every rank's alike; 4 would add nothing but MirroredStrategy
tracing about twice as long): batches of 8 split 4 + 4, those of 5 split 3 + 2.
"""

import random

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def _script(runner, x, y):
    """Shuffled fits of every kind, with evaluate between them; then what the process's
    generators draw next."""
    keras.utils.set_random_seed(7)
    history = runner.fit(x, y, batch_size=8, epochs=3, verbose=0,
                         validation_data=(x[:10], y[:10])).history  # shuffle=True
    runner.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle="batch")
    runner.evaluate(x, y, batch_size=8, verbose=0)
    runner.fit(_Batches(x, y, 8), epochs=2, verbose=0, shuffle=True)
    runner.fit(x, y, batch_size=5, epochs=1, verbose=0)  # 9 batches, the last of 4 rows
    draws = [random.random(), np.random.random()]
    if keras.backend.backend() == "torch":
        import torch

        draws.append(torch.rand(3).tolist())
    return history, draws


@pytest.fixture(scope="module")
def runs():
    x, y = data("mlp", 44)
    x, y = x.astype("float32"), y.astype("float32")
    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    want = _script(ref, x, y)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with few_steps():
        got = _script(kmgpu.parallelize(model, gpus=2), x, y)
    return ref, model, want, got


def test_shuffled_fits_equal_one_device(runs):
    ref, model, (want, _), (got, _) = runs
    assert rel_diff(ref.get_weights(), model.get_weights()) < TOL
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=TOL, err_msg=key)


def test_random_states_end_where_plain_keras_leaves_them(runs):
    _, _, (_, want), (_, got) = runs
    assert got == want

"""``kmgpu.engines.loss_rows``: the rule read from a loss's values on a batch and its two
parts, and the first batch of a call read without changing what the call reads."""

import numpy as np

from kmgpu.engines import loss_rows


def test_rules_from_values_on_the_batch_and_its_parts():
    n, first = 9, 3
    mean_rows = [2.0, 4.0, 1.0]  # 9 rows: (3 * 4 + 6 * 1) / 9 = 2
    constant = [0.5, 0.5, 0.5]
    summed = [7.0, 3.0, 4.0]
    assert loss_rows._classify([[v[i] for v in (mean_rows, constant, summed)]
                                for i in range(3)], n, first) == (
        loss_rows.SHARE, loss_rows.SHARE, loss_rows.WHOLE)
    odd = loss_rows._classify([[4.0], [9.0], [1.0]], n, first)  # a square of the batch mean
    assert isinstance(odd, str) and "model.losses[0]" in odd
    assert isinstance(loss_rows._classify([[1.0], [1.0, 2.0], [1.0]], n, first), str)


def test_first_batch_of_a_generator_is_given_back():
    batches = [(np.full((2, 1), i, "float32"), np.zeros((2, 1), "float32")) for i in range(3)]
    kwargs, batch = loss_rows.first_batch({"x": iter(batches)})
    assert np.array_equal(batch[0], batches[0][0]) and batch[2] is None
    assert [b[0][0, 0] for b in kwargs["x"]] == [0.0, 1.0, 2.0]


def test_first_batch_of_arrays_is_batch_size_rows():
    x = np.arange(20, dtype="float32").reshape(10, 2)
    _, batch = loss_rows.first_batch({"x": x, "y": x[:, :1], "batch_size": 4})
    assert batch[0].shape == (4, 2) and batch[1].shape == (4, 1)
    _, batch = loss_rows.first_batch({"x": x}, whole=True)
    assert batch[0].shape == (10, 2)

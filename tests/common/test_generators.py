"""A Python generator with ``steps_per_epoch``, as existing training scripts pass it, trains
on N devices exactly as on one (every batch once per epoch, in order), on every backend.
TensorFlow cuts each global batch into per-replica rows; torch ships each rank its rows.
2 devices (4 would add nothing: MirroredStrategy traces about twice as long on 4): batches
of 12 rows split 6 + 6, the last batch of the 45-row case (9 rows) 5 + 4.
"""

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


@pytest.mark.parametrize("samples", [48, 45])
def test_generator_with_steps_per_epoch_equals_one_device(samples):
    x, y = data("mlp", samples)
    seen = []

    def batches():
        while True:
            for i in range(0, samples, 12):
                seen.append(i)
                yield x[i:i + 12], y[i:i + 12]

    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    want = ref.fit(batches(), steps_per_epoch=4, epochs=3, verbose=0).history
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    seen.clear()
    with few_steps():
        got = parallel.fit(batches(), steps_per_epoch=4, epochs=3, verbose=0).history
    assert seen[:12] == [0, 12, 24, 36] * 3  # every batch once per epoch, in order
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=TOL, err_msg=key)

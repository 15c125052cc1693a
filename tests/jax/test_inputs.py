"""Input kinds whose parity is backend-specific (see tests/tensorflow/test_inputs.py)."""

import kmgpu
from tests.helpers import data, mlp, rel_diff

TOL = 1e-5


def test_pydataset_input():
    import keras

    x, y = data("mlp", 45)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[i * 12:(i + 1) * 12], y[i * 12:(i + 1) * 12]

    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(Batches(), epochs=2, shuffle=False, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="sgd", loss="mse")
    parallel.fit(Batches(), epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert parallel.predict(Batches(), verbose=0).shape == (45, 1)

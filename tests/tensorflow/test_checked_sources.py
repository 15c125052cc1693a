"""On TensorFlow a torch ``DataLoader`` is fed per replica like a generator or a
PyDataset (``engines/tensorflow/data``): each of its batches gets the checks of
``engines/batch_checks`` and is split as kmgpu splits a batch; before, Keras's own
adapter read it. (Several workers, ``kmgpu launch``: tests/tensorflow/test_launch.)

Models and data from ``tests/common/test_every_batch``: an own loss that is a mean over
rows but 0 on one row; 77 rows in batches of 8, whose last batch of 5 rows kmgpu's even
split gives 2 + 1 + 1 + 1.
"""

import warnings

import numpy as np
import torch

import kmgpu
from tests.common.test_every_batch import _loss_model, _sum_mean_model, _xy
from tests.helpers import rel_diff


def _loader(x, y, size=8, shuffle=False):
    data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    return torch.utils.data.DataLoader(data, batch_size=size, shuffle=shuffle)


def _quiet_fit(parallel, data, **kwargs):
    with warnings.catch_warnings():  # Keras: shuffle is ignored for a DataLoader
        warnings.filterwarnings("ignore", message=".*DataLoader is expected")
        return parallel.fit(data, verbose=0, **kwargs)


def test_dataloader_last_batch_split_unevenly_trains_as_one_device():
    """Its last batch of 5 rows gives replicas one row each, where the own loss is 0
    (refused at that batch before the layer ran on the global batch)."""
    x, y = (a[:77] for a in _xy())
    reference, model = _loss_model(), _loss_model()
    _quiet_fit(reference, _loader(x, y), epochs=1)
    _quiet_fit(kmgpu.parallelize(model), _loader(x, y), epochs=1)
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_shuffled_dataloader_trains_as_one_device():
    """Sum and mean own losses, 2 epochs of a shuffled DataLoader (validation: arrays):
    equal to one device, History included: one pass an epoch, reshuffled by the loader
    from torch's random state as Keras reads it (before: 0.72 from one device). 2 devices
    (batches of 7 split 4 + 3): the order of the rows is the same on any count."""
    x, y = _xy()
    reference, model = _sum_mean_model(), _sum_mean_model()
    histories = []
    for runner in (reference, kmgpu.parallelize(model, gpus=2)):
        torch.manual_seed(0)
        histories.append(_quiet_fit(runner, _loader(x, y, 7, shuffle=True), epochs=2,
                                    validation_data=(x[:20], y[:20])))
    one, many = histories
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(many.history[key], one.history[key], rtol=1e-5)
    assert len(many.history["loss"]) == 2

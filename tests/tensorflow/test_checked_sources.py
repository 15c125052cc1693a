"""On TensorFlow every data source's later batches get the first batch's checks
(``engines/batch_checks``, ``engines/tensorflow/data.checked``): a torch ``DataLoader``
(Keras reads it as a ``tf.data`` pipeline of its own), and a generator or PyDataset where
kmgpu does not feed them per replica (several workers, ``kmgpu launch``: here the same
path on one worker's 4 devices, ``_single_worker`` forced off).

Models and data from ``tests/common/test_every_batch``: an own loss that is a mean over
rows but 0 on one row; 77 rows in batches of 8, whose last batch of 5 rows
``tf.distribute`` splits 2 + 2 + 1 + 0.
"""

import warnings

import numpy as np
import pytest

import kmgpu
from kmgpu.engines.tensorflow import engine as tf_engine
from tests.common.test_every_batch import _Listed, _loss_model, _sum_mean_model, _xy
from tests.helpers import rel_diff

import torch  # noqa: E402  (the venv has every backend)


def _loader(x, y, size=8):
    data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    return torch.utils.data.DataLoader(data, batch_size=size)


def _quiet_fit(parallel, data, **kwargs):
    with warnings.catch_warnings():  # Keras: shuffle is ignored for a DataLoader
        warnings.filterwarnings("ignore", message=".*DataLoader is expected")
        return parallel.fit(data, shuffle=False, verbose=0, **kwargs)


def test_dataloader_batch_whose_split_breaks_the_loss_stops_there():
    x, y = (a[:77] for a in _xy())
    reference, model = _loss_model(), _loss_model()
    _quiet_fit(reference, _loader(x[:72], y[:72]), epochs=1)
    with pytest.raises(NotImplementedError, match=r"batch 9 .*on a batch's 5 rows"):
        _quiet_fit(kmgpu.parallelize(model), _loader(x, y), epochs=1)
    assert int(model.optimizer.iterations.numpy()) - 9 in (0, 1)  # Keras counts the failed one
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5


def test_dataloader_checked_trains_as_one_device():
    """Sum and mean own losses, 2 epochs of a DataLoader (training and validation):
    equal to one device, History included (the checked pipeline keeps one pass an
    epoch)."""
    x, y = _xy()
    reference, model = _sum_mean_model(), _sum_mean_model()
    one = _quiet_fit(reference, _loader(x, y, 7), epochs=2,
                     validation_data=_loader(x[:20], y[:20], 7))
    many = _quiet_fit(kmgpu.parallelize(model), _loader(x, y, 7), epochs=2,
                      validation_data=_loader(x[:20], y[:20], 7))
    assert rel_diff(reference.get_weights(), model.get_weights()) < 1e-5
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(many.history[key], one.history[key], rtol=1e-5)
    assert len(many.history["loss"]) == 2


@pytest.fixture
def several_workers(monkeypatch):
    """The engine as under ``kmgpu launch``: Python data goes to Keras's own adapters."""
    monkeypatch.setattr(tf_engine.TensorFlowEngine, "_single_worker", lambda self: False)


@pytest.mark.parametrize("kind", ["generator", "pydataset"])
def test_python_data_not_fed_per_replica_is_checked_batch_by_batch(several_workers, kind):
    x, y = (a[:77] for a in _xy())
    batches = [(x[s:s + 8], y[s:s + 8]) for s in range(0, 77, 8)]
    data = (b for b in batches) if kind == "generator" else _Listed(batches)
    with pytest.raises(NotImplementedError, match=r"batch 9 .*on a batch's 5 rows"):
        _quiet_fit(kmgpu.parallelize(_loss_model()), data, epochs=1)


def test_pydataset_read_by_processes_refused_before_any_work(several_workers):
    x, y = _xy()
    data = _Listed([(x[s:s + 6], y[s:s + 6]) for s in range(0, 78, 6)])  # 13 steps
    data.use_multiprocessing = True
    model = _loss_model()
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match=r"use_multiprocessing=False"):
        _quiet_fit(kmgpu.parallelize(model), data, epochs=1)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not model.optimizer.built

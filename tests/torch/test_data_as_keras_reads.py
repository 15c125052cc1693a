"""The torch pool reads data and gives logs as plain Keras does on one device.

4 simulated devices against one plain Keras fit, the tests' MLP:

- the logs a callback gets at every batch end (training and validation, the
  uneven last batch included) are one device's running means, not rank 0's;
- a DataLoader shuffled by its own generator: every epoch takes the batches Keras's
  fit takes (Keras makes the DataLoader's iterator again at each epoch end, which
  draws from the generator);
- arrays as validation_data beside a DataLoader: Keras's default batch (32);
- a validation generator with validation_steps: each validation replays the batches
  Keras peeked at, then continues the generator.

- a DataLoader shuffled by torch's global generator (none of its own), validated on
  arrays every second epoch: Keras's validations make DataLoader iterators, which
  draw from that generator, so the next epoch's shuffle and a seeded script's later
  draws (after fit, evaluate, predict) depend on them;
- under batch="per_replica", arrays validating a dataset take Keras's default batch
  per device: 32 x N.

Three fits per side serve every test: a DataLoader fit, a generator-validation fit and
a fit on a DataLoader without its own generator (per_replica).
"""

import numpy as np
import pytest
import torch

import kmgpu
from tests.helpers import batch_logs, data, few_steps, mlp, rel_diff

TOL = 1e-5


def _loader(x, y):
    rows = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(rows, batch_size=12, shuffle=True,
                                       generator=torch.Generator().manual_seed(3))


def _validation_batches():
    rng = np.random.default_rng(9)
    while True:
        a = rng.normal(size=(10, 5)).astype("float32")
        yield a, a.sum(axis=1, keepdims=True)


def _fit(parallel, kind):
    """(History, batch logs, trained weights) of one 3-epoch fit; 45 rows: batches 12,
    12, 12, 9 (on 4 devices the last splits 3, 2, 2, 2)."""
    x, y = data("mlp", 45)
    model = mlp()
    target = kmgpu.parallelize(model, gpus=4) if parallel else model
    target.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    logs = batch_logs()
    if kind == "loader":
        vx, vy = data("mlp", 40, seed=5)  # Keras's batch 32: 32 + 8 rows
        args = dict(x=_loader(x, y), validation_data=(vx, vy))
    else:  # validation: 3 batches of 10 rows (3, 3, 2, 2 on 4 devices)
        args = dict(x=x, y=y, batch_size=12, shuffle=False,
                    validation_data=_validation_batches(), validation_steps=3)
    if parallel:
        with few_steps():
            history = target.fit(**args, epochs=3, verbose=0, callbacks=[logs])
    else:
        history = target.fit(**args, epochs=3, verbose=0, callbacks=[logs])
    return history.history, logs, model.get_weights()


def _global_generator_fit(parallel):
    """(History, batch logs, trained weights, three draws after fit, evaluate and
    predict) of a 4-epoch fit on a DataLoader that shuffles with torch's global
    generator, validated on 40 rows of arrays after epochs 2 and 4. kmgpu runs it
    with batch="per_replica" (no LR scaling): the validation batch is 32 x 4, so one
    device validates with 128."""
    x, y = data("mlp", 45)
    vx, vy = data("mlp", 40, seed=5)
    rows = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(rows, batch_size=8, shuffle=True)
    model = mlp()
    target = model
    if parallel:
        target = kmgpu.parallelize(model, gpus=4, batch="per_replica", scale_lr=False)
    target.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    logs = batch_logs()
    args = dict(validation_data=(vx, vy), validation_freq=2, epochs=4, verbose=0,
                callbacks=[logs])
    torch.manual_seed(0)
    if parallel:
        with pytest.warns(UserWarning, match="scale_lr=False"):  # the trap, said once
            history = target.fit(loader, **args)
    else:
        history = target.fit(loader, validation_batch_size=128, **args)
    draws = [torch.rand(2).tolist()]
    target.evaluate(vx, vy, verbose=0)
    draws.append(torch.rand(2).tolist())
    target.predict(vx, verbose=0)
    draws.append(torch.rand(2).tolist())
    return history.history, logs, model.get_weights(), draws


@pytest.fixture(scope="module")
def global_generator_fits():
    """One device's fit on a DataLoader without its own generator and kmgpu's."""
    return _global_generator_fit(False), _global_generator_fit(True)


@pytest.fixture(scope="module")
def loader_fits():
    """One device's DataLoader fit and kmgpu's."""
    return _fit(False, "loader"), _fit(True, "loader")


@pytest.fixture(scope="module")
def generator_fits():
    """One device's fit validating on a generator and kmgpu's."""
    return _fit(False, "generator"), _fit(True, "generator")


def _same_history(one, many):
    assert one.keys() == many.keys()
    for key in one:
        np.testing.assert_allclose(many[key], one[key], rtol=TOL, err_msg=key)


def _same_logs(one, many):
    assert len(one) == len(many) and one
    for i, (a, b) in enumerate(zip(one, many)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=TOL, err_msg=f"batch {i} {key}")


def test_every_batch_end_gets_one_devices_logs(generator_fits):
    (_, one, _), (_, many, _) = generator_fits
    assert len(one.train) == 12 and len(one.test) == 9
    _same_logs(one.train, many.train)
    _same_logs(one.test, many.test)


def test_a_dataloader_with_its_own_generator_equals_one_device_every_epoch(loader_fits):
    (h1, one, w1), (hn, many, wn) = loader_fits
    np.testing.assert_allclose(hn["loss"], h1["loss"], rtol=TOL)
    _same_logs(one.train, many.train)
    assert rel_diff(w1, wn) <= TOL


def test_arrays_validating_a_dataloader_fit_take_keras_default_batch(loader_fits):
    (h1, one, _), (hn, many, _) = loader_fits
    assert len(one.test) == 6  # 2 batches (32 + 8 rows) per epoch
    _same_history(h1, hn)
    _same_logs(one.test, many.test)


def test_a_validation_generator_replays_its_peeked_batches_then_continues(generator_fits):
    (h1, _, w1), (hn, _, wn) = generator_fits
    assert len(set(np.round(h1["val_loss"], 4))) == 3  # each validation on other batches
    _same_history(h1, hn)
    assert rel_diff(w1, wn) <= TOL


def test_arrays_validating_a_globally_shuffled_dataloader_draw_as_keras(global_generator_fits):
    (h1, one, w1, _), (hn, many, wn, _) = global_generator_fits
    assert len(h1["val_loss"]) == 2
    _same_history(h1, hn)
    _same_logs(one.train, many.train)
    assert rel_diff(w1, wn) <= TOL


def test_a_seeded_scripts_later_draws_are_keras_s(global_generator_fits):
    (_, _, _, d1), (_, _, _, dn) = global_generator_fits
    assert dn == d1  # after fit, after evaluate, after predict


def test_per_replica_validation_batch_of_arrays_beside_a_dataset_is_32_per_device(
        global_generator_fits):
    (_, one, _, _), (_, many, _, _) = global_generator_fits
    assert len(one.test) == 2  # one batch of 40 rows per validation (128 > 40)
    _same_logs(one.test, many.test)

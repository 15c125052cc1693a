"""Arrays kept on the device, copied in chunks on a thread beside the steps
(engines/torch/data/resident.py; a CUDA device in use, a CPU here): the same batches as the
host arrays, a batch that waits only for its own rows, and a failed copy that raises in
the caller instead of handing out rows never written."""

import threading

import numpy as np
import pytest
import torch

from kmgpu.engines.torch.data import inputs, resident


def _arrays(n=45):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"), np.arange(n, dtype="int64"),
            rng.uniform(size=n).astype("float32"))


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
def test_chunked_copy_gives_the_host_batches(monkeypatch, shuffle):
    """Chunks of 4 rows (16 + 8 + 4 bytes a row), batches of 10: every batch, shuffled
    or not, holds the host arrays' rows, for two epochs; the copy ran in 12 chunks."""
    from kmgpu.engines.torch.data import shuffle as orders

    monkeypatch.setattr(resident, "CHUNK_BYTES", 4 * 24)
    chunks = []
    copy = resident._copy
    monkeypatch.setattr(resident, "_copy", lambda pairs, lo, hi: (chunks.append((lo, hi)),
                                                                  copy(pairs, lo, hi)))
    x, y, w = _arrays()
    torch.manual_seed(3)
    plain = inputs.RankSlices(inputs.ArraySource(x, y, w), 10, 0, 1, shuffle=shuffle)
    device_source = resident.DeviceArraySource(inputs.ArraySource(x, y, w), "cpu")
    kept = inputs.RankSlices(device_source, 10, 0, 1, shuffle=shuffle)
    for _ in range(2):
        start = orders.state()
        plain.on_epoch_begin()
        want = [plain[s] for s in range(len(plain))]
        orders.set_state(start)
        kept.on_epoch_begin()
        for s, a in enumerate(want):
            for u, v in zip(a, kept[s]):
                np.testing.assert_array_equal(u, v.numpy())
    assert kept.source.copied() == 45
    assert chunks == [(lo, min(lo + 4, 45)) for lo in range(0, 45, 4)]


def test_a_batch_waits_only_for_its_rows(monkeypatch):
    """With the copy held after its first chunk, the first batch's rows are handed out;
    a batch beyond them waits until the copy goes on, then gets the right rows."""
    monkeypatch.setattr(resident, "CHUNK_BYTES", 10 * 24)
    go, copy = threading.Event(), resident._copy

    def held(pairs, lo, hi):
        if lo > 0:
            go.wait(30)
        copy(pairs, lo, hi)

    monkeypatch.setattr(resident, "_copy", held)
    x, y, w = _arrays()
    source = resident.DeviceArraySource(inputs.ArraySource(x, y, w), "cpu")
    first = source.take(slice(0, 10))
    np.testing.assert_array_equal(first[0].numpy(), x[:10])
    assert source.copied() == 10
    got = []
    reader = threading.Thread(target=lambda: got.append(source.take(slice(30, 40))))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got  # waiting for rows 30-39
    go.set()
    reader.join(30)
    np.testing.assert_array_equal(got[0][1].numpy(), y[30:40])
    order = torch.as_tensor(np.arange(45)[::-1].copy())
    np.testing.assert_array_equal(source.take(order)[0].numpy(), x[::-1])


def test_a_failed_copy_raises_in_the_caller(monkeypatch):
    """A chunk whose copy fails: rows copied before it are still handed out; a batch that
    needs the failed rows raises (with the cause), never returns unwritten memory."""
    monkeypatch.setattr(resident, "CHUNK_BYTES", 10 * 24)
    copy = resident._copy

    def failing(pairs, lo, hi):
        if lo >= 20:
            raise MemoryError("out of host memory")
        copy(pairs, lo, hi)

    monkeypatch.setattr(resident, "_copy", failing)
    x, y, w = _arrays()
    source = resident.DeviceArraySource(inputs.ArraySource(x, y, w), "cpu")
    with pytest.raises(RuntimeError, match="copying the arrays to the device failed.*"
                                           "out of host memory"):
        source.take(slice(15, 25))
    np.testing.assert_array_equal(source.take(slice(0, 20))[0].numpy(), x[:20])


def test_a_host_batch_moves_to_the_step_device():
    """A DataLoader's batch (CPU tensors) goes to the step's device before the step (the
    "meta" device stands in for a GPU here); arrays, None and tensors already there stay."""
    on_meta = torch.zeros(2, device="meta")
    x = {"ids": torch.ones(4, 3, dtype=torch.int32), "mask": np.ones((4, 3), bool)}
    moved = resident.batch_on((x, torch.zeros(4), None), "meta")
    assert moved[0]["ids"].device.type == "meta" and moved[0]["ids"].dtype == torch.int32
    assert moved[0]["mask"] is x["mask"] and moved[2] is None
    assert moved[1].device.type == "meta"
    assert resident.batch_on((on_meta, None, None), "meta")[0] is on_meta


def test_every_captured_step_takes_its_batch_through_batch_on(monkeypatch):
    """A fit on a torch DataLoader through kmgpu's split step on one device
    (compile(jit_compile=True) on a CPU): each train step's batch passes ``batch_on`` with
    the model's device, and the fit equals Keras's own on the same DataLoader."""
    import keras

    import kmgpu

    calls = []
    batch_on = resident.batch_on
    monkeypatch.setattr(resident, "batch_on",
                        lambda batch, device: (calls.append(str(device)),
                                               batch_on(batch, device))[1])
    x, y, _ = _arrays(80)  # 10 steps an epoch: no few-steps warning
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y[:, None]
                                                                              .astype("float32"))),
        batch_size=8)
    models = []
    for jit in (False, True):  # Keras's eager step; kmgpu's split step
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
        models.append(model)
    models[0].fit(loader, epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="single replica"):
        parallel = kmgpu.parallelize(models[1], gpus=1)
    parallel.fit(loader, epochs=2, verbose=0)
    assert calls == ["cpu"] * 20
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

"""compile(jit_compile=True) on torch: kmgpu's split step (graphs.py), as it runs on a CPU.

CUDA graphs need a GPU; the stages they capture (A: forward, loss, gradients into a
flat buffer; one all-reduce; B: optimizer and metrics) run here eagerly, and must
train exactly as Keras's eager step, on 1, 2 and 4 gloo ranks, last partial batch
and stand-in rows included. A capture that fails must fall back to eager with one
line saying why (the capture is forced here: a fake that replays by re-running).
"""

from contextlib import nullcontext

import numpy as np
import torch
import pytest

import kmgpu
from tests.helpers import conv_bn, data, few_steps, mlp, one_device, rel_diff

TOL = 1e-5


def _close_pools():
    from kmgpu.engines.torch.launch import launchers

    launchers.close_pools()


def _fit(build, x, y, gpus, jit, batch=20, epochs=2, sync=False, shuffle=False, **fit):
    model = build()
    kwargs = {} if gpus is None else {"gpus": gpus, "sync_batchnorm": sync}
    with one_device() if gpus == 1 else nullcontext():
        runner = model if gpus is None else kmgpu.parallelize(model, **kwargs)
    runner.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=jit)
    torch.manual_seed(7)  # what the shuffle draws from (engines/torch/data/shuffle.py): both runs
    warns = gpus is not None and -(-len(x) // batch) < 10  # kmgpu's note on few steps
    with few_steps() if warns else nullcontext():
        history = runner.fit(x, y, batch_size=batch, epochs=epochs, shuffle=shuffle, verbose=0,
                             **fit)
    return model, history.history, runner


def _same_history(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=TOL, err_msg=key)


def test_one_device_split_step_is_kerass_step_bit_for_bit():
    x, y = data("conv_bn", 97)  # batches of 20 and a last one of 17
    ref, ref_history, _ = _fit(conv_bn, x, y, None, jit=False)
    model, history, parallel = _fit(conv_bn, x, y, 1, jit=True,
                                    validation_data=(x[:30], y[:30]))
    assert type(parallel._engine).__name__ == "TorchLocalEngine"
    assert "split step" in parallel.describe() and "jit_compile=True" in parallel.describe()
    assert rel_diff(ref.get_weights(), model.get_weights()) == 0.0
    _same_history(ref_history, {k: v for k, v in history.items() if not k.startswith("val_")})
    assert "val_loss" in history
    # the user's model is as it was: Keras's step, jit_compile as compiled
    assert model.jit_compile is True and "train_step" not in model.__dict__
    pred = parallel.predict(x[:7], verbose=0)
    np.testing.assert_allclose(pred, ref.predict(x[:7], verbose=0), rtol=1e-6, atol=1e-6)
    # a second fit goes on from the trained state, as Keras's does
    ref.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL


@pytest.mark.parametrize("gpus", [2, 4])
def test_split_step_on_ranks_equals_one_device_and_the_eager_ddp_step(gpus):
    """MLP and Conv+BN (sync BatchNorm): equal to one device; Conv+BN with per-replica
    BatchNorm (moving statistics averaged over ranks): equal to kmgpu's eager DDP step."""
    x, y = data("mlp", 97)
    ref, ref_history, _ = _fit(mlp, x, y, None, jit=False)
    model, history, parallel = _fit(mlp, x, y, gpus, jit=True)
    assert "split step" in parallel.describe()
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    _same_history(ref_history, history)

    x, y = data("conv_bn", 97)
    ref, ref_history, _ = _fit(conv_bn, x, y, None, jit=False)
    model, history, _ = _fit(conv_bn, x, y, gpus, jit=True, sync=True)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    _same_history(ref_history, history)

    eager, eager_history, _ = _fit(conv_bn, x, y, gpus, jit=False, shuffle=True)
    model, history, parallel = _fit(conv_bn, x, y, gpus, jit=True, shuffle=True)
    assert rel_diff(eager.get_weights(), model.get_weights()) <= TOL
    _same_history(eager_history, history)
    ranks = parallel._engine.rank_weights()
    for other in ranks[1:]:  # every rank holds the same weights and statistics
        for a, b in zip(ranks[0], other):
            np.testing.assert_array_equal(a, b)


def test_stand_in_rows_on_four_ranks():
    """42 samples, batch 20: the last batch has 2 rows, so ranks 2 and 3 get a stand-in
    row with no weight in the split step too."""
    x, y = data("mlp", 42)
    ref, ref_history, _ = _fit(mlp, x, y, None, jit=False)
    model, history, _ = _fit(mlp, x, y, 4, jit=True)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    _same_history(ref_history, history)


# -- capture, forced on a CPU -------------------------------------------------------------
class _FakeGraph:
    """Stands in for a CUDA graph: replay runs the recorded function again and writes
    its results into the tensors the capture returned (as a replay would)."""

    def __init__(self, fn):
        self.fn = fn

    def pool(self):
        return None

    def replay(self):
        import keras

        new = self.fn()
        for old, fresh in zip(keras.tree.flatten(self.recorded), keras.tree.flatten(new)):
            if old is not None:
                old.copy_(fresh)


def _forced_capture(monkeypatch, fail_update, fail_forward=False):
    from kmgpu.engines.torch.capture import graphs

    calls = []

    def capture(fn, pool=None):
        calls.append(pool)
        if fail_forward or (fail_update and len(calls) % 2 == 0):
            raise RuntimeError("simulated capture failure\nsecond line")
        graph = _FakeGraph(fn)
        graph.recorded = fn()  # the forward pass only writes the flat buffer: no step taken
        return graph, graph.recorded

    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "capture", capture)
    return calls


def test_a_failing_capture_falls_back_to_eager_with_one_line(monkeypatch, capsys):
    from kmgpu.engines.torch.capture import graphs

    x, y = data("mlp", 97)
    ref, ref_history, _ = _fit(mlp, x, y, None, jit=False)
    calls = _forced_capture(monkeypatch, fail_update=False, fail_forward=True)
    model, history, _ = _fit(mlp, x, y, 1, jit=True)
    out = capsys.readouterr().out
    assert len(calls) == graphs.CAPTURE_TRIES  # each after a warm-up, then never again
    assert out.count("capturing the train step failed") == 1
    assert "simulated capture failure" in out and "second line" not in out
    assert rel_diff(ref.get_weights(), model.get_weights()) == 0.0
    _same_history(ref_history, history)


def test_replayed_forward_with_an_eager_update_equals_kerass_step(monkeypatch, capsys):
    """Graph A 'replayed' on static input buffers, graph B's capture failing: the
    optimizer and metrics run eagerly after it (one line says so), still exact."""
    x, y = data("mlp", 97)
    ref, ref_history, _ = _fit(mlp, x, y, None, jit=False, epochs=3)
    calls = _forced_capture(monkeypatch, fail_update=True)
    model, history, _ = _fit(mlp, x, y, 1, jit=True, epochs=3)
    out = capsys.readouterr().out
    # the full batch is captured (A, then B fails); the last batch of 17 stays eager
    assert len(calls) == 2 and out.count("run eagerly after the captured") == 1
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    _same_history(ref_history, history)


def test_on_two_ranks_a_failing_capture_keeps_every_rank_in_step(monkeypatch, capsys):
    """Forked workers inherit the forced failure; both ranks fall back and still meet
    in the same one all-reduce per step."""
    _close_pools()
    try:
        _forced_capture(monkeypatch, fail_update=False, fail_forward=True)
        x, y = data("mlp", 97)
        ref, ref_history, _ = _fit(mlp, x, y, None, jit=False)
        model, history, _ = _fit(mlp, x, y, 2, jit=True)
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
        _same_history(ref_history, history)
        assert "capturing the train step failed" in capsys.readouterr().out
    finally:
        _close_pools()  # no worker keeps the forced failure


def test_device_scalars_give_kerass_values():
    import torch
    from keras.src.backend.torch import core  # noqa: the function the fix swaps

    from kmgpu.engines.torch import capture_fixes

    f = core.convert_to_tensor
    values = [1, 2**40, -3, 1.5, 0.1, True, [1, 2, 3], (2.5, 1.0), [True, False]]
    want = [f(v) for v in values] + [f(0.1, "float16"), f(3, "float32"), f(2, "int64")]
    with capture_fixes.device_scalars(), capture_fixes.device_scalars():
        got = [f(v) for v in values] + [f(0.1, "float16"), f(3, "float32"), f(2, "int64")]
        again = f([1, 2, 3])
    assert f.__kwdefaults__ is None  # swapped back
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    again.add_(1)  # a cached constant list is handed out as a copy
    with capture_fixes.device_scalars():
        assert f([1, 2, 3]).tolist() == [1, 2, 3]


# -- rows kept on the device (resident.DeviceArraySource; a CUDA device in use, a CPU here) ----
@pytest.mark.parametrize("shuffle", [False, True, "batch"])
def test_rows_on_the_device_give_the_same_batches(shuffle):
    from kmgpu.engines.torch.data import inputs, resident, shuffle as orders

    x, y = data_of(45)
    torch.manual_seed(3)
    for world in (2, 3):
        for rank in range(world):
            plain = inputs.RankSlices(inputs.ArraySource(x, y), 20, rank, world, shuffle=shuffle)
            device_source = resident.DeviceArraySource(inputs.ArraySource(x, y), "cpu")
            kept = inputs.RankSlices(device_source, 20, rank, world, shuffle=shuffle)
            for epoch in range(2):
                start = orders.state()  # each pass draws its order: from the same states
                plain.on_epoch_begin()
                want = [(plain[s], plain.current) for s in range(len(plain))]
                orders.set_state(start)
                kept.on_epoch_begin()
                for s, (a, current) in enumerate(want):
                    b = kept[s]
                    assert kept.current == current
                    for u, v in zip(a, b):
                        np.testing.assert_array_equal(u, v.numpy())


def data_of(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), np.arange(n, dtype="int64")


def test_one_device_fit_from_rows_on_the_device(monkeypatch):
    """The one-device captured fit feeds Keras a PyDataset of device rows (as on a GPU),
    copied there in chunks of 8 rows on a thread beside the steps."""
    from kmgpu.engines.torch.data import resident

    made = []
    monkeypatch.setattr(resident, "CHUNK_BYTES", 8 * 4 * 6)  # mlp: 5 features + 1 target

    def on_device(source, device):
        made.append(resident.DeviceArraySource(source, device))
        return made[-1]

    monkeypatch.setattr(resident, "on_device", on_device)
    x, y = data("mlp", 97)
    ref, ref_history, _ = _fit(mlp, x, y, None, jit=False, validation_data=(x[:30], y[:30]))
    model, history, _ = _fit(mlp, x, y, 1, jit=True, validation_data=(x[:30], y[:30]))
    assert len(made) == 1 and made[0].copied() == 97
    assert rel_diff(ref.get_weights(), model.get_weights()) == 0.0
    _same_history(ref_history, history)


def test_a_new_graph_pool_gets_the_memory_eager_steps_left_cached(monkeypatch):
    """``cuda_graphs.capture``: before a graph opens a private pool, the caching allocator
    hands its cached blocks back (a pool cannot reuse them: on an 80 GB GPU ResNet-50 at 224
    ran out capturing its test step after the train step's); a graph that shares a pool
    given to it frees nothing. torch.cuda faked: the calls in order."""
    import contextlib

    from kmgpu.engines.torch.capture import cuda_graphs

    calls = []

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode=None):
            calls.append(("begin", pool))

        def capture_end(self):
            calls.append("end")

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: calls.append("new pool") or "pool")
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graphs, "side_stream", lambda device=None: None)
    graph, out = cuda_graphs.capture(lambda: calls.append("step") or 7)
    assert out == 7 and calls == ["sync", "empty_cache", "new pool", ("begin", "pool"),
                                  "step", "end"]
    calls.clear()
    cuda_graphs.capture(lambda: calls.append("step"), pool="shared")
    assert calls == ["sync", ("begin", "shared"), "step", "end"]

"""torch: the captured step by default on CUDA devices, random layers included.

``graphs.choose_step`` decides the step: a model compiled the usual way gets the captured step
where there is a CUDA device, Keras's eager step on a CPU; ``run_eagerly=True`` turns
the capture off. A "GPU" is simulated here (``graphs.available`` True, a fake capture
whose replay re-runs the recorded stage, as test_captured_step does). While kmgpu's
step runs, Keras's random functions draw from the seed generators' device state
(``capture_fixes.device_random``, ``rng``): fresh numbers every step and on every rank, the
same numbers for the same seed.
"""

import keras
import numpy as np
import torch
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff
from tests.torch.test_captured_step import _close_pools, _fit, _forced_capture, _same_history


def _strict_capture(monkeypatch):
    """The fake capture of test_captured_step, which also refuses what CUDA-graph capture
    refuses and a CPU allows: reading a tensor on the host (``int(t)``, ``.item()``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from kmgpu.engines.torch.capture import graphs

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                raise RuntimeError("operation not permitted when stream is capturing")
            return func(*args, **(kwargs or {}))

    calls = _forced_capture(monkeypatch, fail_update=True)
    fake = graphs.capture

    def capture(fn, pool=None):
        with NoHostReads():
            return fake(fn, pool)

    monkeypatch.setattr(graphs, "capture", capture)
    return calls


def _one(model):
    with pytest.warns(UserWarning, match="kmgpu: one device"):
        return kmgpu.parallelize(model, gpus=1)


_MODEL = []


def _compiled(**compile_kwargs):
    """One small model, compiled anew (compile is cheap, building is not)."""
    if not _MODEL:
        _MODEL.append(mlp())
    _MODEL[0].compile(optimizer="adam", loss="mse", **compile_kwargs)
    return _MODEL[0]


def test_plan_says_which_step_each_compile_gets():
    from kmgpu.engines.torch.capture import graphs

    class Own(keras.Sequential):
        def train_step(self, batch):
            return super().train_step(batch)

    own = Own(mlp().layers)
    own.compile(optimizer="adam", loss="mse")
    for on_gpu, kwargs, kind in [
            (True, {}, graphs.SPLIT), (True, {"jit_compile": False}, graphs.SPLIT),
            (True, {"jit_compile": True}, graphs.SPLIT),
            (True, {"run_eagerly": True}, graphs.KERAS),
            (False, {}, graphs.KERAS), (False, {"jit_compile": True}, graphs.SPLIT)]:
        assert graphs.choose_step(_compiled(**kwargs), on_gpu)[0] == kind, (on_gpu, kwargs)
    assert graphs.choose_step(own, True)[0] == graphs.OWN
    assert "run_eagerly=True" in graphs.choose_step(_compiled(run_eagerly=True), True)[1]
    assert "CPU" in graphs.describe(_compiled(), False, 1)
    assert graphs.describe(_compiled(), True, 2).startswith("captured")


def test_default_on_a_gpu_is_the_captured_step_on_one_device_and_on_two(monkeypatch):
    """Compiled the usual way (and before wrapping): captured, Keras's weights; with
    run_eagerly=True nothing is captured; close() drops the graphs. (The fake graph B
    would run the optimizer once more at capture: it fails, so B runs eagerly.)"""
    _close_pools()
    try:
        calls = _forced_capture(monkeypatch, fail_update=True)
        x, y = data("mlp", 97)
        ref, ref_history, _ = _fit(mlp, x, y, None, jit=False, batch=8)
        model, history, parallel = _fit(mlp, x, y, 1, jit="auto", batch=8)  # asserts the one-device note
        assert len(calls) == 2  # graph A and graph B of the full batch
        assert parallel.describe().count("captured: forward+backward") == 1
        assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5
        _same_history(ref_history, history)
        assert model.jit_compile is False and "train_step" not in model.__dict__
        parallel.close()
        assert parallel._engine._step is None and parallel._engine.graph_memory() == 0

        model = mlp()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"], run_eagerly=True)
        parallel = _one(model)
        torch.manual_seed(7)  # the shuffle draws from it (engines/torch/data/shuffle.py)
        parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert len(calls) == 2 and "Keras's eager step" in parallel.describe()

        model, history, parallel = _fit(mlp, x, y, 2, jit="auto", batch=8)  # the ranks
        assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5
        _same_history(ref_history, history)
    finally:
        _close_pools()


def test_own_train_step_on_a_gpu_says_once_why_it_is_eager(monkeypatch, capsys):
    from kmgpu.engines.torch.capture import graphs

    monkeypatch.setattr(graphs, "available", lambda device: True)

    class Own(keras.Sequential):
        def train_step(self, batch):
            return super().train_step(batch)

    x, y = data("mlp", 40)
    model = Own(mlp().layers)
    model.build((None, x.shape[1]))
    parallel = _one(model)
    parallel.compile(optimizer="adam", loss="mse")
    for _ in range(2):
        parallel.fit(x, y, batch_size=4, epochs=1, verbose=0)
    out = capsys.readouterr().out
    assert out.count("not captured: a model's own train_step") == 1
    assert "own train_step" in parallel.describe()


# -- random numbers on the device ---------------------------------------------------------
def test_device_random_draws_fresh_reproducible_numbers_without_host_copies():
    from keras.src.backend.torch import random as keras_random  # noqa: the swapped module

    from kmgpu.engines.torch import capture_fixes

    before = keras_random.normal

    def draws():
        gen = keras.random.SeedGenerator(11)
        with capture_fixes.device_random():
            a = keras.random.normal((20000,), seed=gen)
            b = keras.random.normal((20000,), seed=gen)
            u = keras.random.uniform((20000,), 2.0, 3.0, seed=gen)
            r = keras.random.randint((20000,), 0, 7, seed=gen)
            c = keras.random.normal((5,), seed=3), keras.random.normal((5,), seed=3)
        return a.numpy(), b.numpy(), u.numpy(), r.numpy(), c, gen.state.numpy()

    a, b, u, r, (c1, c2), state = draws()
    assert keras_random.normal is before  # swapped back
    assert list(state) == [11, 4]  # one step of the state per draw, on the device
    assert abs(a.mean()) < 0.03 and abs(a.std() - 1) < 0.03 and not np.allclose(a, b)
    assert 2.0 <= u.min() and u.max() < 3.0 and abs(u.mean() - 2.5) < 0.01
    assert set(np.unique(r)) == set(range(7))
    assert np.array_equal(c1.numpy(), c2.numpy())  # an int seed: Keras's same numbers
    again = draws()
    for x, y in zip((a, b, u, r), again[:4]):
        np.testing.assert_array_equal(x, y)


class Record(keras.layers.Layer):
    """Keeps its input's first column of 4 rows (training only): a device write in the
    step, so a replay writes it too."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(4,), initializer="zeros", trainable=False,
                                    name="seen")

    def call(self, x, training=None):
        if training:
            self.seen.assign(x[:4, 0])
        return x


def _noisy():
    keras.utils.set_random_seed(4)
    L = keras.layers
    inputs = keras.Input((6,))
    h = L.GaussianNoise(0.5, seed=1)(L.Dropout(0.5, seed=2)(inputs))
    h = Record(name="record")(L.Dropout(0.3, noise_shape=(None, 1))(h))
    return keras.Model(inputs, L.Dense(1)(h))


def _noisy_fit(gpus, batch=8, steps=10, record=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 6)).astype("float32") + 2.0
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    model = _noisy()
    parallel = _one(model) if gpus == 1 else kmgpu.parallelize(model, gpus=gpus)
    parallel.compile(optimizer="adam", loss="mse", jit_compile=True)
    callbacks = [] if record is None else [keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: record.append(
            model.get_layer("record").seen.numpy().copy()))]
    torch.manual_seed(7)  # the shuffle draws from it (engines/torch/data/shuffle.py)
    parallel.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                 callbacks=callbacks)
    return model, parallel


def test_random_layers_replay_fresh_masks_and_a_seed_repeats_the_training(monkeypatch,
                                                                          capsys):
    calls = _strict_capture(monkeypatch)
    seen = []
    model, _ = _noisy_fit(1, record=seen)
    assert len(calls) == 2  # captured (no host read), random layers included
    assert "capturing the train step failed" not in capsys.readouterr().out
    replayed = [s.tobytes() for s in seen[2:]]  # the captured step and its replays
    assert len(replayed) == 8 and len(set(replayed)) == 8
    again, _ = _noisy_fit(1)
    assert rel_diff(model.get_weights(), again.get_weights()) == 0.0


def test_random_layers_draw_apart_on_every_rank(monkeypatch, capsys):
    _close_pools()
    try:
        _strict_capture(monkeypatch)  # the forked workers inherit it
        _, parallel = _noisy_fit(2)
        out = capsys.readouterr().out
        assert "optimizer and metrics run eagerly" in out  # rank 0 captured graph A
        assert "capturing the train step failed" not in out
        ranks = parallel._engine.rank_weights()
        index = [i for i, v in enumerate(parallel.model.weights) if "seen" in v.path]
        assert len(index) == 1
        assert not np.allclose(ranks[0][index[0]], ranks[1][index[0]])
        for a, b, v in zip(ranks[0], ranks[1], parallel.model.weights):
            if v.trainable:  # the same update on every rank
                np.testing.assert_array_equal(a, b)
    finally:
        _close_pools()


@pytest.mark.parametrize("layer", ["RandomFlip", "RandomCrop", "RandomRotation"])
def test_augmentation_layers_draw_from_the_device_state(layer):
    """RandomCrop crops at device offsets (index_select), the others warp with device
    draws; each call draws new ones."""
    import torch

    from kmgpu.engines.torch import capture_fixes

    make = {"RandomFlip": lambda: keras.layers.RandomFlip(seed=1),
            "RandomCrop": lambda: keras.layers.RandomCrop(5, 5, seed=2),
            "RandomRotation": lambda: keras.layers.RandomRotation(0.3, seed=3)}[layer]
    images = torch.arange(8 * 8 * 8 * 3, dtype=torch.float32).reshape(8, 8, 8, 3)
    aug = make()
    with capture_fixes.device_random():
        first, second = aug(images, training=True), aug(images, training=True)
    assert not torch.equal(first, second)
    if layer == "RandomCrop":  # a window of the image, as Keras's own crop
        h, w = [int(v) for v in torch.nonzero(images[0, :, :, 0] == first[0, 0, 0, 0])[0]]
        assert torch.equal(first, images[:, h:h + 5, w:w + 5, :])

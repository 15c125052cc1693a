"""torch: what reaches the ranks of a multi-GPU run, and captures that copy nothing.

- ``tf32=`` reaches every rank's step (a layer records the flags the step ran under).
- ``AUC`` and ``BinaryIoU`` capture whole (graph B and the test step) under a fake
  capture as strict as CUDA's: it refuses a tensor made from host data (a pageable
  host-to-device copy, "Cannot copy between CPU and CUDA tensors during CUDA graph
  capture") and a host read.
- On 2 gloo ranks, evaluate, predict and fit's validation run the rank's captured test
  and predict steps (here faked: forked workers inherit the fake) with one device's
  numbers, every row once, in order.
"""

import keras
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kmgpu
from tests.helpers import data, few_steps, one_device, rel_diff

TOL = 1e-5
X, Y = data("mlp", 97)
Y = (Y > 0).astype("float32")
XV, YV = X[:43] + 0.1, Y[:43]


def _close_pools():
    from kmgpu.engines.torch.launch import launchers

    launchers.close_pools()


class _Strict(TorchDispatchMode):
    """Inside a (fake) capture: what CUDA-graph capture refuses raises, and every tensor
    the function writes in place is put back afterwards (a capture runs nothing)."""

    def __init__(self):
        super().__init__()
        self.saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default:  # torch.as_tensor(host data)
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph "
                               "capture (a tensor made from host data)")
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in (t if isinstance(t, (list, tuple)) else [t]):  # _foreach_*_
                    if torch.is_tensor(t) and id(t) not in self.saved:
                        self.saved[id(t)] = (t, t.clone())
        return func(*args, **kwargs)


def _strict_capture(monkeypatch, fail_rank=None):
    """``graphs.capture`` faked: records ``fn``'s outputs with nothing changed (the
    writes undone), replay runs ``fn`` again into them; prints one line per capture.
    ``fail_rank``: on that rank the test and predict captures raise."""
    from kmgpu.engines.torch.capture import graphs

    class Graph:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def pool(self):
            return None

        def replay(self):
            for old, new in zip(keras.tree.flatten(self.out), keras.tree.flatten(self.fn())):
                if old is not None:
                    old.copy_(new)

    def capture(fn, pool=None):
        names = fn.__code__.co_names
        kind = "a" if "forward_backward" in names else "b" if "update" in names else "eval"
        if kind == "eval" and fail_rank is not None and torch.distributed.get_rank() == fail_rank:
            raise RuntimeError("simulated eval capture failure")
        strict = _Strict()
        with strict:
            out = fn()
        with torch.no_grad():
            for t, value in strict.saved.values():
                t.copy_(value)
        print("fake capture:", kind)
        return Graph(fn, out), out

    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "capture", capture)


def _classifier(metrics):
    keras.utils.set_random_seed(4)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="adam", loss="binary_crossentropy", metrics=metrics())
    return m


def _confusion_metrics():
    return [keras.metrics.AUC(), keras.metrics.BinaryIoU(),
            keras.metrics.BinaryIoU(target_class_ids=[1], threshold=0.4),
            keras.metrics.Precision(thresholds=[0.3, 0.6]), "accuracy"]


def _run(runner, batch=8):
    history = runner.fit(X, Y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                         validation_data=(XV, YV))
    ev = runner.evaluate(XV, YV, batch_size=batch, verbose=0)
    pred = runner.predict(XV, batch_size=5, verbose=0)
    return history.history, ev, pred


def _same(ref, got):
    (h, ev, pred), (gh, gev, gpred) = ref, got
    assert len(h) == len(gh)
    for (k, a), b in zip(h.items(), gh.values()):  # names: auc vs auc_1
        np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7, err_msg=k)
    assert len(ev) == len(gev) == 6
    for a, b in zip(ev, gev):  # Precision at two thresholds: a list
        np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7)
    assert gpred.shape == pred.shape == (43, 1)  # every row once
    np.testing.assert_allclose(gpred, pred, rtol=TOL, atol=1e-7)  # in order


@pytest.fixture(scope="module")
def reference():
    """Plain Keras on one device: (history, evaluate, predict), weights."""
    ref = _classifier(_confusion_metrics)
    return _run(ref), ref.get_weights()


def test_auc_and_iou_capture_whole_on_one_device(monkeypatch, capsys, reference):
    """Graph B and the test step with AUC (numpy thresholds), BinaryIoU (its target ids, a list
    attribute Keras tracks as a TrackedList: converted in result()) and Precision at
    thresholds, under the strict capture: nothing eager, Keras's numbers."""
    want = reference
    model = _classifier(_confusion_metrics)
    _strict_capture(monkeypatch)
    with one_device():
        parallel = kmgpu.parallelize(model, gpus=1)
    got = _run(parallel)
    out = capsys.readouterr().out
    assert "eagerly" not in out, out
    assert out.count("fake capture") >= 4  # graph A, graph B, test, predict
    _same(want[0], got)
    assert rel_diff(want[1], model.get_weights()) <= TOL


class _SeenTF32(keras.layers.Layer):
    """Records, while training, the flags the step runs under: 1 * matmul + 2 * cuDNN
    TF32 (the identity on its inputs)."""

    def build(self, shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="seen")

    def call(self, x, training=False):
        if training:
            self.seen.assign(float(torch.backends.cuda.matmul.allow_tf32)
                             + 2.0 * float(torch.backends.cudnn.allow_tf32))
        return x


def test_tf32_reaches_every_rank():
    """tf32=False and tf32=True of the same model on 2 gloo ranks: each rank's step ran
    under the flags asked for (the process's own settings are put back after)."""
    _close_pools()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), _SeenTF32(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)  # the split step on a CPU
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for tf32, flags in ((False, 0.0), (True, 3.0)):
            parallel = kmgpu.parallelize(model, gpus=2, tf32=tf32)
            with few_steps():
                parallel.fit(X[:40], Y[:40], batch_size=8, epochs=1, verbose=0)
            ranks = parallel._engine.rank_weights()
            assert len(ranks) == 2
            assert [float(r[0]) for r in ranks] == [flags, flags]
            assert float(model.layers[0].seen.numpy()) == flags
            assert (torch.backends.cuda.matmul.allow_tf32,
                    torch.backends.cudnn.allow_tf32) == saved
    finally:
        _close_pools()


@pytest.mark.parametrize("fail_rank", [None, 0])
def test_evaluate_and_predict_on_two_ranks_are_captured_and_equal_one_device(
        monkeypatch, capsys, reference, fail_rank):
    """2 gloo ranks, captures faked (strict) in the forked workers: fit with validation,
    evaluate (43 rows, batch 8: a last batch of 3 split 2 + 1) and predict (batch 5:
    a stand-in row) equal plain Keras on one device, every row once, in order. With
    rank 0's test and predict captures failing, rank 0 runs them eagerly while rank 1
    replays: the same numbers, and no rank waits for the other."""
    want = reference
    _close_pools()
    try:
        _strict_capture(monkeypatch, fail_rank)
        model = _classifier(_confusion_metrics)
        parallel = kmgpu.parallelize(model, gpus=2)
        got = _run(parallel)
        out = capsys.readouterr().out
        kinds = [ln.split()[-1] for ln in out.splitlines() if ln.startswith("fake capture")]
        # rank 0's lines reach this process: graph A, graph B, the test and predict steps
        assert kinds.count("a") == kinds.count("b") == 1, out
        if fail_rank is None:
            assert "eagerly" not in out and kinds.count("eval") >= 2, out
        else:
            assert out.count("capturing the test step failed") == 1, out
            assert out.count("capturing the predict step failed") == 1, out
            assert "simulated eval capture failure" in out and kinds.count("eval") == 0, out
        _same(want[0], got)
        assert rel_diff(want[1], model.get_weights()) <= TOL
    finally:
        _close_pools()

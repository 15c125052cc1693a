"""torch: the whole run on the captured path, and fallbacks that leave torch clean.

A "GPU" is simulated as in test_captured_step (``graphs.available`` True, a fake capture
whose replay re-runs the recorded function). On one device, ``evaluate``, ``predict``
and fit's validation run Keras's own test / predict steps captured (here: faked), the
last partial batch eagerly, and must give Keras's rows, order and numbers. Every capture
that fails (train graph A, graph B, test, predict) falls back to eager with the same
numbers and one line each, and leaves Keras's functions and torch's random state as
they were: a plain Keras model with Dropout trains afterwards as it would have anyway.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

TOL = 1e-5


def _model():
    keras.utils.set_random_seed(3)
    m = mlp()
    m.compile(optimizer="adam", loss="mse", metrics=["mae", keras.metrics.RootMeanSquaredError()])
    return m


def _fake_capture(monkeypatch, model_box, fail=()):
    """Capture is faked: the recording runs the function once for its output structure
    with every variable (weights, optimizer, metrics) put back after it (a real capture runs nothing); replay
    runs it again into those outputs. ``fail``: the kinds whose capture raises
    ("a", "b", "test", "predict", told apart by the function's name)."""
    from kmgpu.engines.torch.capture import graphs

    calls = []

    class Graph:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def pool(self):
            return None

        def replay(self):
            fresh = self.fn()
            for old, new in zip(keras.tree.flatten(self.out), keras.tree.flatten(fresh)):
                if old is not None:
                    old.copy_(new)

    def capture(fn, pool=None):
        kind = _kind(fn)
        calls.append(kind)
        if kind in fail:
            raise RuntimeError(f"simulated {kind} capture failure\nsecond line")
        model = model_box[0]
        state = list(model.variables) + [v for m in model.metrics for v in m.variables]
        if model.optimizer is not None and model.optimizer.built:
            state += list(model.optimizer.variables)
        saved = [(v, v.value.clone()) for v in state]
        out = fn()
        for v, value in saved:
            v.value.data.copy_(value)
        return Graph(fn, out), out

    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "capture", capture)
    return calls


def _kind(fn):
    import inspect

    text = inspect.getsource(fn)
    if "forward_backward" in text:
        return "a"
    if "split.update" in text:
        return "b"
    return "eval"


def _strict_fake_capture(monkeypatch, model_box):
    """``_fake_capture`` whose recording refuses what CUDA-graph capture refuses: a read
    of a device value on the host (``.item()``, a Python ``if`` on a tensor) and a tensor
    made from host data (``torch.tensor(list)``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from kmgpu.engines.torch.capture import graphs

    calls = _fake_capture(monkeypatch, model_box)
    fake = graphs.capture
    refused = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default)

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in refused:
                raise RuntimeError("operation not permitted when stream is capturing")
            return func(*args, **(kwargs or {}))

    def strict(fn, pool=None):
        with NoHostReads():
            return fake(fn, pool)

    monkeypatch.setattr(graphs, "capture", strict)
    return calls


X, Y = data("mlp", 97)
XV, YV = data("mlp", 43, seed=1)


def _run(runner):
    history = runner.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                         validation_data=(XV, YV), validation_freq=2)
    history2 = runner.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                          validation_split=0.3)
    ev = runner.evaluate(XV, YV, batch_size=10, verbose=0, return_dict=True)
    pred = runner.predict(XV, batch_size=5, verbose=0)
    return history.history, history2.history, ev, pred


@pytest.fixture(scope="module")
def reference():
    model = _model()
    return model.get_weights(), _run(model)


def _parallel(monkeypatch, fail=()):
    model = _model()
    calls = _fake_capture(monkeypatch, [model], fail)
    with pytest.warns(UserWarning, match="kmgpu: one device"):
        parallel = kmgpu.parallelize(model, gpus=1)
    return model, parallel, calls


def _same(ref, got):
    (h1, h2, ev, pred), (g1, g2, gev, gpred) = ref, got
    for a, b in ((h1, g1), (h2, g2), (ev, gev)):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=TOL, atol=1e-7, err_msg=k)
    assert gpred.shape == pred.shape == (43, 1)  # every row, in order
    np.testing.assert_allclose(gpred, pred, rtol=TOL, atol=1e-7)


def test_evaluate_predict_and_validation_are_captured_and_equal_kerass(monkeypatch, reference,
                                                                         capsys):
    weights, ref = reference
    model, parallel, calls = _parallel(monkeypatch)
    got = _run(parallel)
    assert calls.count("a") == 1 and calls.count("b") == 1  # the full batch of 8
    # test steps: validation batches of 8 and 10 (evaluate); predict of 5
    assert calls.count("eval") >= 3
    engine = parallel._engine
    assert len(engine._eval.graphs) >= 3 and "eagerly" not in capsys.readouterr().out
    _same(ref, got)
    assert rel_diff(model.get_weights(), _model().get_weights()) > 0  # it trained
    # the user's model keeps Keras's own steps outside kmgpu's calls
    assert not {"test_step", "predict_step", "train_step"} & set(model.__dict__)


def test_evaluate_and_predict_give_way_when_the_gpu_is_full(monkeypatch, reference, capsys):
    """A predict step that runs out of GPU memory beside the test step's graph (a large
    model on a full GPU: the train step's graphs, the test graph, then predict's warm-up
    step): the test and predict graphs are dropped, both steps run eagerly from there on,
    one line says so, and every number is Keras's."""
    import torch

    from kmgpu.engines.torch.capture import eval_steps

    _, ref = reference
    function, raised = eval_steps.CapturedEval._function, []

    def short_of_memory(self, kind, rows):
        fn = function(self, kind, rows)

        def step(*batch):
            if kind == "predict" and not raised:
                raised.append(kind)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return fn(*batch)

        return step

    monkeypatch.setattr(eval_steps.CapturedEval, "_function", short_of_memory)
    model, parallel, calls = _parallel(monkeypatch)
    _same(ref, _run(parallel))
    assert raised == ["predict"]
    assert capsys.readouterr().out.count("ran out of GPU memory") == 1
    steps = parallel._engine._eval
    assert steps.graphs == {} and {"test", "predict"} <= set(steps.refused)


@pytest.mark.parametrize("fail", [("a",), ("b", "eval")])
def test_a_failed_capture_of_any_step_runs_eagerly_and_leaves_torch_clean(monkeypatch, reference,
                                                                           capsys, fail):
    from keras.src.backend.torch import core, random  # noqa: the functions kmgpu swaps

    code, dropout = core.convert_to_tensor.__code__, random.dropout
    _, ref = reference
    model, parallel, calls = _parallel(monkeypatch, fail)
    _same(ref, _run(parallel))
    out = capsys.readouterr().out
    if "a" in fail:
        assert out.count("capturing the train step failed") == 1
    else:
        assert out.count("run eagerly after the captured") == 1
        assert out.count("capturing the test step failed") == 1
        assert out.count("capturing the predict step failed") == 1
    assert "simulated" in out and "second line" not in out
    # Keras's own functions are back, and torch's random stream is where a plain run puts it
    assert core.convert_to_tensor.__code__ is code and random.dropout is dropout
    import torch

    def plain_dropout_fit():
        keras.utils.set_random_seed(5)
        torch.manual_seed(5)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                              keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
        m.fit(X, Y, batch_size=32, epochs=1, verbose=0)
        return m.get_weights()

    assert rel_diff(plain_dropout_fit(), plain_dropout_fit()) == 0.0


@pytest.mark.parametrize("accumulate", [2, None], ids=["accumulation", "flat"])
def test_graph_b_captures_loss_scaling_accumulation_and_confusion_metrics(monkeypatch, capsys,
                                                                          accumulate):
    """A LossScaleOptimizer (what mixed_float16 compiles), gradient_accumulation_steps and
    confusion-matrix metrics in graph B, captured under a fake that refuses host reads as
    CUDA-graph capture does: no eager fallback, Keras's weights and history. With
    gradient_accumulation_steps Keras's own update runs (its conds as device selects);
    without, kmgpu's flat update (the loss scale's skip as one select per buffer)."""

    def build():
        keras.utils.set_random_seed(4)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
        opt = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(gradient_accumulation_steps=accumulate),
            dynamic_growth_steps=3)
        m.compile(optimizer=opt, loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(), keras.metrics.Precision(thresholds=[0.3, 0.6]),
                           keras.metrics.Recall(), keras.metrics.F1Score(threshold=0.5),
                           keras.metrics.BinaryIoU(), "accuracy"])
        return m

    x, y = X.astype("float32"), (Y > 0).astype("float32")
    ref = build()
    ref_history = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    model = build()
    calls = _strict_fake_capture(monkeypatch, [model])
    with pytest.warns(UserWarning, match="kmgpu: one device"):
        parallel = kmgpu.parallelize(model, gpus=1)
    history = parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert "eagerly" not in capsys.readouterr().out and calls == ["a", "b"]
    flat = "kmgpu's flat Adam update" in parallel._engine._step.split.optimizer_path
    assert flat is (accumulate is None)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert float(model.optimizer.dynamic_scale.numpy()) == float(ref.optimizer.dynamic_scale.numpy())
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    assert len(ref_history) == len(history) == 7
    for (k, a), b in zip(ref_history.items(), history.values()):  # names: auc vs auc_1
        np.testing.assert_allclose(a, b, rtol=TOL, err_msg=k)


def test_callbacks_see_the_epochs_weights_during_validation():
    """While fit validates, the user's model holds the epoch's weights
    and iteration count, as in plain Keras (TensorBoard logs evaluation_*_vs_iterations
    at on_test_end's optimizer.iterations)."""

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_test_begin(self, logs=None):
            self.seen.append((int(self.model.optimizer.iterations.numpy()),
                              float(np.sum(self.model.get_weights()[0]))))

    def fit(gpus):
        model = _model()
        seen = Seen()
        runner = model if gpus is None else kmgpu.parallelize(model, gpus=gpus)
        runner.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                   validation_data=(XV, YV), callbacks=[seen])
        return seen.seen

    ref = fit(None)
    got = fit(2)
    assert [i for i, _ in got] == [i for i, _ in ref] == [13, 26]
    np.testing.assert_allclose([w for _, w in got], [w for _, w in ref], rtol=1e-5)


def test_device_scalars_keep_numpy_constants_by_content():
    """AUC's thresholds are a numpy array: converted once per content and device (a copy
    from pageable host memory is what CUDA-graph capture refuses), same values as Keras."""
    from keras.src.backend.torch import core  # noqa: the function the fix swaps

    from kmgpu.engines.torch import capture_fixes

    f = core.convert_to_tensor
    values = [np.linspace(0, 1, 7), np.float64(0.25), np.arange(3, dtype="int32"),
              np.where(True, 3, 1)]
    want = [f(v) for v in values]
    with capture_fixes.device_scalars():
        got = [f(v) for v in values]
        a = values[0].copy()
        first = f(a)
        a[0] = 9.0  # a changed array is another constant
        second = f(a)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_array_equal(w.numpy(), g.numpy())
    assert float(first[0]) == 0.0 and float(second[0]) == 9.0


def test_tf32_policy_is_one_argument_said_by_describe_and_scoped(monkeypatch):
    import torch

    from kmgpu.engines.torch import precision
    from kmgpu.engines.torch.capture import graphs

    model = _model()
    with pytest.raises(TypeError, match="tf32"):
        kmgpu.parallelize(model, gpus=1, tf32="yes")
    monkeypatch.setattr(graphs, "available", lambda device: True)
    for tf32, words in [(True, "in TF32 inside kmgpu's steps"), (False, "full float32")]:
        with pytest.warns(UserWarning, match="kmgpu: one device"):
            assert words in kmgpu.parallelize(model, gpus=1, tf32=tf32).describe()
    # applied only inside kmgpu's steps: the process's settings come back
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    with precision.matmul_precision(not saved[0]):
        assert matmul.allow_tf32 is (not saved[0]) and cudnn.allow_tf32 is (not saved[0])
    assert (matmul.allow_tf32, cudnn.allow_tf32) == saved


def test_device_cond_equals_kerass_branches_with_overflow_accumulation_and_ema():
    """The device select of ops.cond (graph B) against Keras's Python if, with steps whose
    gradients overflow (LossScaleOptimizer skips them and halves the scale), gradient
    accumulation and EMA overwrites: every weight and optimizer variable equal."""
    import torch

    from kmgpu.engines.torch import cond_fixes

    def run(device):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(
            gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=3),
            dynamic_growth_steps=2)
        opt.build(m.trainable_variables)
        rng = np.random.default_rng(1)
        for step in range(9):
            grads = [torch.tensor(rng.normal(size=v.shape).astype("float32"))
                     for v in m.trainable_variables]
            if step in (3, 6):
                grads[0][0, 0] = float("inf")
            if device:
                with cond_fixes.device_conditions(opt, m.trainable_variables):
                    opt.apply(grads, m.trainable_variables)
            else:
                opt.apply(grads, m.trainable_variables)
        return [v.numpy() for v in m.weights] + [np.asarray(v.numpy()) for v in opt.variables]

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)

"""torch: every built-in Keras metric, and the hinge losses, captured whole.

Under the fake capture of test_whole_run that refuses host reads as CUDA-graph capture
does, a model compiled with every metric of its kind (binary, one-hot, sparse,
regression: together, every class ``keras.metrics`` exports) trains and evaluates with
nothing printed (no eager fallback of graph B or of the test step) and Keras's own
history and results. Before kmgpu's device ``cond`` spanned the whole step and its
``max(initial=)``, Hinge/SquaredHinge (their 0/1-label ``cond``) and the four metrics at a
fixed recall, precision, sensitivity or specificity (``max(..., initial=0)`` in
``result()``) made graph B and the test step run eagerly. A metric class Keras adds
later fails ``test_every_metric_class_has_a_kind`` until it is given one here.
"""

import inspect

import keras
import numpy as np
import pytest

import kmgpu
from tests.torch.metric_cases import KINDS, NOT_METRICS, _case
from tests.torch.test_whole_run import _strict_fake_capture

TOL = 1e-5


def _run(runner, x, y):
    history = runner.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    results = runner.evaluate(x, y, batch_size=4, verbose=0)
    return history, results, runner.predict(x, batch_size=4, verbose=0)


def test_every_metric_class_has_a_kind():
    exported = {n for n in dir(keras.metrics) if inspect.isclass(getattr(keras.metrics, n))
                and issubclass(getattr(keras.metrics, n), keras.metrics.Metric)}
    listed = [n for names in KINDS.values() for n in names]
    assert len(listed) == len(set(listed))
    assert exported - NOT_METRICS == set(listed)


@pytest.mark.parametrize("kind,loss", [("binary", "hinge"), ("onehot", None),
                                       ("sparse", None), ("regression", None)])
def test_metrics_and_hinge_losses_are_captured_and_equal_kerass(monkeypatch, capsys, kind,
                                                                 loss):
    """10 steps of 4 rows: 2 eager warm-up steps, the capture, 7 replays; the binary
    metrics under the hinge loss (its label ``cond`` in graph A, differentiated)."""
    build, x, y = _case(kind, loss)
    ref = _run(build(), x, y)
    model = build()
    calls = _strict_fake_capture(monkeypatch, [model])
    with pytest.warns(UserWarning, match="kmgpu: one device"):
        parallel = kmgpu.parallelize(model, gpus=1)
    history, results, pred = _run(parallel, x, y)
    assert capsys.readouterr().out == ""  # no "... runs eagerly" line
    assert calls == ["a", "b", "eval", "eval"]  # train A and B, test, predict: captured once each
    (ref_history, ref_results, ref_pred) = ref
    assert len(history) == len(ref_history) == len(KINDS[kind]) + 1
    for (name, a), b in zip(ref_history.items(), history.values()):  # names: auc vs auc_1
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=TOL, atol=1e-7,
                                   err_msg=name)
    for a, b in zip(ref_results, results):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=TOL, atol=1e-7)
    np.testing.assert_allclose(pred, ref_pred, rtol=TOL, atol=1e-7)
    assert pred.shape[0] == 40

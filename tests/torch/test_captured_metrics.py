"""torch, issue 28: every built-in Keras metric, and the hinge losses, captured whole.

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
from tests.torch.test_whole_run import _strict_fake_capture

TOL = 1e-5

KINDS = {
    "binary": ["AUC", "Accuracy", "BinaryAccuracy", "BinaryCrossentropy", "BinaryIoU",
               "FalseNegatives", "FalsePositives", "TrueNegatives", "TruePositives",
               "Hinge", "SquaredHinge", "Precision", "Recall", "PrecisionAtRecall",
               "RecallAtPrecision", "SensitivityAtSpecificity", "SpecificityAtSensitivity"],
    "onehot": ["CategoricalAccuracy", "CategoricalCrossentropy", "CategoricalHinge",
               "F1Score", "FBetaScore", "KLDivergence", "Poisson", "TopKCategoricalAccuracy",
               "OneHotIoU", "OneHotMeanIoU"],
    "sparse": ["SparseCategoricalAccuracy", "SparseCategoricalCrossentropy",
               "SparseTopKCategoricalAccuracy", "IoU", "MeanIoU"],
    "regression": ["MeanSquaredError", "MeanAbsoluteError", "RootMeanSquaredError",
                   "MeanAbsolutePercentageError", "MeanSquaredLogarithmicError",
                   "LogCoshError", "R2Score", "CosineSimilarity", "PearsonCorrelation",
                   "ConcordanceCorrelation"],
}
NOT_METRICS = {"Metric", "Mean", "Sum", "MeanMetricWrapper"}  # bases, not a measure


def _metric(name):
    cls = getattr(keras.metrics, name)
    few = dict(num_thresholds=20)  # Keras's 200 only make the test slower
    args = {"AUC": few, "PrecisionAtRecall": dict(recall=0.5, **few),
            "RecallAtPrecision": dict(precision=0.5, **few),
            "SensitivityAtSpecificity": dict(specificity=0.5, **few),
            "SpecificityAtSensitivity": dict(sensitivity=0.5, **few),
            "F1Score": dict(threshold=0.5), "FBetaScore": dict(threshold=0.5),
            "TopKCategoricalAccuracy": dict(k=2), "SparseTopKCategoricalAccuracy": dict(k=2),
            "IoU": dict(num_classes=3, target_class_ids=[0, 2], sparse_y_pred=False),
            "MeanIoU": dict(num_classes=3, sparse_y_pred=False),
            "OneHotIoU": dict(num_classes=3, target_class_ids=[0, 2]),
            "OneHotMeanIoU": dict(num_classes=3)}.get(name, {})
    return cls(**args)


def _case(kind, loss=None):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, 5)).astype("float32")
    labels = rng.integers(0, 3, 40)
    y, head, default_loss = {
        "binary": ((labels > 0).astype("float32")[:, None], ("sigmoid", 1), "binary_crossentropy"),
        "onehot": (np.eye(3, dtype="float32")[labels], ("softmax", 3), "categorical_crossentropy"),
        "sparse": (labels, ("softmax", 3), "sparse_categorical_crossentropy"),
        "regression": (rng.normal(size=(40, 1)).astype("float32"), (None, 1), "mse"),
    }[kind]

    def build():
        keras.utils.set_random_seed(4)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(head[1], activation=head[0])])
        m.compile(optimizer="adam", loss=loss or default_loss,
                  metrics=[_metric(n) for n in KINDS[kind]])
        return m

    return build, x, y


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

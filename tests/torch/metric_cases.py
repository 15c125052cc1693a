"""Every class ``keras.metrics`` exports, by the kind of labels it measures, and a tiny
model for each kind: shared by ``test_captured_metrics.py`` (CPU, the fake capture) and
``benchmarks/lab/torch_capture_checks.py`` (CUDA). No pytest here: the GPU image
runs the bench without it."""

import keras
import numpy as np

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

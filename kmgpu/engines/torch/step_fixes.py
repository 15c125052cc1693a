"""Keras's torch train, test and predict steps as kmgpu's rank steps use them: which steps
a model keeps, the loss as Keras's steps compute it, and the logs Keras makes of metric
variables (read after they are summed over ranks, relayed as plain numbers to the
driver's callbacks). Keras 3.15 has no DDP in its torch trainer (keras master has), so
kmgpu's rank step works through the documented ``train_step`` / ``test_step`` extension
points and these few internals. Rows of ``kmgpu/engines/torch/keras_fixes.py``.
"""

import functools

from kmgpu.engines import keras_fixes


def _trainer():
    from keras.src.backend.torch.trainer import TorchTrainer

    return TorchTrainer


def has_own_train_step(model):
    """True when ``model``'s class overrides Keras's torch ``train_step``."""
    return type(model).train_step is not _trainer().train_step


def has_own_test_step(model):
    """True when ``model``'s class overrides Keras's torch ``test_step``."""
    return type(model).test_step is not _trainer().test_step


def has_own_predict_step(model):
    """True when ``model``'s class overrides Keras's torch ``predict_step``."""
    return type(model).predict_step is not _trainer().predict_step


def keras_evaluate(model):
    """Keras's own torch ``evaluate``, bound to ``model`` (to wrap it on the instance)."""
    return _trainer().evaluate.__get__(model)


def read_logs_within(model, context):
    """Make Keras read ``model``'s metric results within ``context()``.

    Keras's torch trainer turns metric variables into logs in
    ``_get_metrics_result_or_logs(logs)`` at every epoch and evaluation end. This
    replaces it on the instance: ``context()`` is a context manager yielding True when
    it changed the variables for the read (then the logs are made plain Python
    numbers before it puts them back).
    """
    read = _trainer()._get_metrics_result_or_logs.__get__(model)  # Keras's own

    def get_metrics_result_or_logs(logs):
        with context() as changed:
            out = read(logs)
            if changed and out is logs and isinstance(logs, dict):
                # a step of the user's own returned other keys than model.metrics (the
                # guide's {m.name: m.result()}): what it named after a metric is that
                # metric's result over every rank, not this rank's last step
                results = {m.name: m.result() for m in model.metrics}
                out = {k: results.get(k, v) for k, v in logs.items()}
            return pythonify_logs(out) if changed else out

    keras_fixes.install(model, "_get_metrics_result_or_logs",
                        lambda current: get_metrics_result_or_logs)
    _read_metrics_once(model)


def build_within(model, context):
    """Make Keras's symbolic build of ``model`` run within ``context()`` (a context
    manager), wrapped on the instance.

    Keras's torch ``fit``, ``evaluate``, ``train_on_batch`` and ``test_on_batch`` start
    with ``_symbolic_build``, which, until the compiled metrics and loss are built,
    calls the model on placeholder inputs (``compute_output_spec``: a "meta" device
    first, eager tensors if that fails) and so reads every weight's value: under a
    mixed precision policy ``Variable.value`` is a cast of the weight, an operation on
    its data even on the meta device, and a regularizer in the loss reads it too. On a
    replica with shard="weights" those weights are freed between steps; ``context``
    gathers them where read (``zero.Shards.active``).
    """
    keras_fixes.install(model, "_symbolic_build",
                        lambda build: functools.partial(_build_within, build, context))


def _build_within(build, context, *args, **kwargs):
    with context():
        return build(*args, **kwargs)


def _read_metrics_once(model):
    """The replica reads its metric variables as Keras's base ``Trainer`` does, with no
    collective of its own: kmgpu sums them over ranks (``read_logs_within``).

    Keras differs here: 3.14 and 3.15's torch trainer does not override
    ``get_metrics_result``; Keras master's (3.16) all-reduces the metric variables
    whenever ``torch.distributed`` is initialised, at every step (``compute_metrics``
    returns it) and again over kmgpu's sums at an epoch's end, which counts a count
    metric (``TruePositives``) once per rank. A model class's own is left alone.
    """
    from keras.src.trainers.trainer import Trainer

    if type(model).get_metrics_result is _trainer().get_metrics_result \
            and _trainer().get_metrics_result is not Trainer.get_metrics_result:
        keras_fixes.install(model, "get_metrics_result",
                            lambda current: Trainer.get_metrics_result.__get__(model))


def detached(tensor):
    """``tensor.detach()`` that keeps the Keras mask on it: Keras's torch layers carry a
    mask on the output tensor itself (``set_keras_mask``), and a loss or metric of a
    masked output reads it there; a plain ``detach()`` is a new tensor without it, so
    metrics computed on it would count the padded steps too."""
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    out = tensor.detach()
    mask = get_keras_mask(tensor)
    if mask is not None:
        set_keras_mask(out, mask.detach())
    return out


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The loss as Keras's torch steps compute it (``Trainer._compute_loss``)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def pythonify_logs(logs):
    """Keras's logs with tensors turned into Python numbers."""
    from keras.src.utils.python_utils import pythonify_logs as pythonify

    return pythonify(logs)


def is_default(method):
    """True when a callback's hook is Keras's own do-nothing default."""
    from keras.src import utils

    return utils.is_default(method)

"""Keras internals the torch engine uses or replaces, in one place.

Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
``tests/unit/test_structure.py`` checks every name still exists. Keras 3.15 has no
DDP in its torch trainer (keras master has), so kmgpu's rank step works through the
documented ``train_step`` / ``test_step`` extension points and these few internals.

Private *instance* attributes the torch engine also reads or sets (no module name
to check, so not in ``PATCHES``; look at them when the pin moves): a model's
``_loss_tracker``, ``_call_has_training_arg``, ``_compile_config`` and
``_initial_epoch`` (Keras's fit resumes from it; BackupAndRestore sets it), an
optimizer's ``_learning_rate``, a layer's ``_seed_generators`` and
``_reduction_axes``, ``CallbackList._history``; for the captured step a model's
``train_function`` / ``test_function`` / ``predict_function`` (set to None so Keras
makes them again without torch.compile). The rank's evaluate wrapper reads fit's private
``_use_cached_eval_dataset`` keyword (True: fit's validation).
"""

from kmgpu.engines.torch import cond_keras_fixes, fast_keras_fixes, graph_keras_fixes
from kmgpu.engines.torch.cond_keras_fixes import step_conditions  # noqa: F401
from kmgpu.engines.torch.fast_keras_fixes import fast_ops  # noqa: F401
from kmgpu.engines.torch.graph_keras_fixes import (  # noqa: F401 (used as keras_fixes.*)
    device_random, device_scalars, fused_batchnorm, set_jit_compile, wants_captured_step)

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.torch.trainer", "TorchTrainer.train_step",
     "compared with the model's own: a model that keeps Keras's step gets kmgpu's DDP "
     "step; one with its own train_step has its gradients averaged in optimizer.apply"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.test_step",
     "compared likewise: Keras's test step is replaced by one that counts only this "
     "rank's real rows in the loss tracker"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.predict_step",
     "compared likewise: a model that keeps Keras's predict (and test) step gets it "
     "captured as a CUDA graph on one device (eval_steps.py)"),
    ("keras.src.backend.torch.trainer", "TorchTrainer._get_metrics_result_or_logs",
     "replaced on each replica: Keras turns metric variables into logs here at epoch "
     "and evaluation ends; kmgpu sums the variables over ranks first (no public hook "
     "sits between the last step and the logs)"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.evaluate",
     "wrapped on each replica so fit's validation and evaluate know their rank slices"),
    ("keras.src.trainers.trainer", "Trainer._compute_loss",
     "kmgpu's steps compute the loss as Keras's own torch steps do"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments",
     "replaced on each replica with sync_batchnorm=True: moments over the global batch "
     "(Keras's torch backend has no synchronised BatchNormalization)"),
    ("keras.src.layers.rnn.rnn", "RNN.call",
     "wrapped on stateful RNN layers of a replica: the torch LSTM/GRU kernels keep the "
     "state variable's tensor for backward and RNN.call then assigns it in place, so a "
     "stateful fit fails with 'modified by an inplace operation' (3.15.1; upstream: no "
     "issue known to kmgpu)"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split",
     "validation_split cut exactly as Keras's fit cuts it"),
    ("keras.src.utils.python_utils", "pythonify_logs",
     "logs as plain Python numbers, to relay them to the driver's callbacks"),
    ("keras.src.utils", "is_default",
     "which hooks a user's callback implements (the test Keras's CallbackList uses)"),
    ("keras.src.trainers.trainer", "Trainer.jit_compile",
     "read on a compiled model (graphs.plan): True asks kmgpu's torch engines for the "
     "split step on a CPU too (Keras's meaning, torch.compile of the step, runs measurably "
     "slower than eager on a GPU); set False on the model that runs kmgpu's step, so Keras "
     "never wraps it in torch.compile"),
    ("keras.src.backend.torch.trainer", "TorchEpochIterator",
     "a tf.data.Dataset, generator or DataLoader read on the driver epoch by epoch "
     "exactly as Keras's torch fit takes it (steps_per_epoch continues one iterator; "
     "a DataLoader's iterator is made at each epoch end too, which draws from its "
     "generator)"),
    ("keras.src.trainers.epoch_iterator", "EpochIterator._enumerate_iterator",
     "enumerated alone (batches are fetched in __next__) over the arrays validating a "
     "dataset fit: it makes the DataLoader iterators of one of fit's validations where "
     "Keras makes them, each drawing a seed from torch's global generator, and reads "
     "no batch"),
    ("keras.src.trainers.trainer", "Trainer._symbolic_build",
     "run on the user's model with that iterator, as Keras's fit and evaluate do first: "
     "it builds the compile metrics and, the first time, starts (and drops) one pass"),
] + graph_keras_fixes.PATCHES + cond_keras_fixes.PATCHES + \
    fast_keras_fixes.PATCHES  # the captured step's rows


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
    read = _trainer()._get_metrics_result_or_logs.__get__(model)

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

    model._get_metrics_result_or_logs = get_metrics_result_or_logs


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The loss as Keras's torch steps compute it (``Trainer._compute_loss``)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def global_batch_moments(layer, sum_over_ranks, real_rows):
    """Replace a BatchNormalization layer's ``_moments`` by moments over the global batch.

    Args:
        layer: a ``keras.layers.BatchNormalization`` of a replica.
        sum_over_ranks: a differentiable all-reduce (sum) of one tensor.
        real_rows: ``real_rows()`` is the number of real rows of this rank's batch
            inside a train step, None outside one (then the layer's own moments).
    """
    import numpy as np
    import torch

    local = layer._moments

    def moments(inputs, mask):
        n_real = real_rows()
        if n_real is None:
            return local(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs[:n_real]
        if mask is None:
            count = float(np.prod([x.shape[a] for a in axes]))
            s1 = torch.sum(x, dim=axes)
            s2 = torch.sum(x * x, dim=axes)
            n = torch.full_like(s1, count)
        else:
            w = mask[:n_real].to(x.dtype)
            w = torch.broadcast_to(w.unsqueeze(-1), x.shape)
            s1 = torch.sum(x * w, dim=axes)
            s2 = torch.sum(x * x * w, dim=axes)
            n = torch.sum(w, dim=axes)
        total = sum_over_ranks(torch.stack([s1, s2, n]))
        mean = total[0] / total[2]
        variance = total[1] / total[2] - mean * mean
        return mean, variance

    layer._moments = moments


def copy_states_in(layer):
    """Run a stateful RNN layer from a copy of its states (this replica only).

    Keras 3.15's torch LSTM and GRU kernels (``backend.lstm`` / ``backend.gru``,
    which bypass ``RNN.inner_loop``'s own copy) multiply by the state variable's
    tensor itself, so autograd saves it; ``RNN.call`` then ``assign``s the new
    states into that tensor in place and ``backward`` fails ("modified by an
    inplace operation"). Given a copy as ``initial_state``, the layer computes
    the same and its own assign still carries the states to the next batch.
    """
    import keras

    call = layer.call

    def call_from_copy(sequences, initial_state=None, **kwargs):
        if initial_state is None:
            initial_state = keras.tree.map_structure(lambda v: v.value.clone(), layer.states)
        return call(sequences, initial_state=initial_state, **kwargs)

    layer.call = call_from_copy


def train_validation_split(arrays, validation_split):
    """Keras's own cut of (x, y, sample_weight) for ``validation_split``.

    Returns:
        ((x, y, sample_weight) to train on, (x, y, sample_weight) to validate on).
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def pythonify_logs(logs):
    """Keras's logs with tensors turned into Python numbers."""
    from keras.src.utils.python_utils import pythonify_logs as pythonify

    return pythonify(logs)


def is_default(method):
    """True when a callback's hook is Keras's own do-nothing default."""
    from keras.src import utils

    return utils.is_default(method)


def epoch_iterator(x, steps_per_epoch=None, build=None):
    """Keras's own ``TorchEpochIterator`` over a dataset, made as fit makes it:
    ``build``'s symbolic build first (a model: fit and evaluate; None: predict), then
    reset. Iterating it once gives one epoch's batches as ``(step, step, [batch])``,
    torch tensors (``feeds.read_pass`` reads them on the CPU, as NumPy).
    """
    from keras.src.backend.torch.trainer import TorchEpochIterator

    iterator = TorchEpochIterator(x=x, steps_per_epoch=steps_per_epoch)
    if build is not None:
        build._symbolic_build(iterator=iterator)
    iterator.reset()
    return iterator


def validation_draws(validation_data, batch_size, steps, steps_per_execution):
    """A function that draws from torch's global generator what one of Keras's fit
    validations over arrays draws, reading no batch.

    Keras's evaluate over fit's cached ``TorchEpochIterator`` resets it and makes a
    DataLoader iterator when the pass starts and another once it has taken every
    batch; each draws a base seed from the global generator (arrays in order draw
    nothing else). Enumerating the same iterator's epoch without fetching makes
    those iterators at the same points.

    Args:
        validation_data: fit's validation arrays, (x, y) or (x, y, sample_weight).
        batch_size: the validation batch Keras takes (None: its default).
        steps: validation_steps.
        steps_per_execution: the model's.
    """
    import keras
    from keras.src.backend.torch.trainer import TorchEpochIterator

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
    iterator = TorchEpochIterator(x=x, y=y, sample_weight=sample_weight,
                                  batch_size=batch_size, steps_per_epoch=steps,
                                  shuffle=False, steps_per_execution=steps_per_execution)

    def draw():
        iterator.reset()
        for _ in iterator._enumerate_iterator():
            pass

    return draw

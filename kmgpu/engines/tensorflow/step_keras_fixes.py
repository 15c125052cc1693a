"""Keras internals the TensorFlow engine's train and test steps use or replace: each
replica's loss weighed by its part of the global batch (``train_step``, ``test_step``,
custom steps, per-output loss trackers), and the metrics read across replicas.

Split from ``keras_fixes`` by role (that module's ``PATCHES`` includes this one's).
Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
"""

import threading

from kmgpu.engines.tensorflow import global_batch

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer",
     "its train_step is replaced on replicas (train_step below) only where the user's "
     "model keeps Keras's own"),
    ("keras.src.trainers.trainer", "Trainer.compute_loss",
     "replaced on replicas of models with their own train_step (exact_custom_steps): its "
     "result is scaled by 1/N for tf.distribute, so a loss tracker fed with it shows the "
     "loss divided by N, and a partial last batch weighs every replica alike"),
    ("keras.src.trainers.compile_utils", "CompileLoss.call",
     "replaced on replicas (weigh_output_losses): it records each output's loss with "
     "weight y_pred.shape[0], None in a traced step, so every replica counts alike"),
    ("keras.src.metrics.reduction_metrics", "Mean.update_state",
     "replaced on the per-output loss trackers, same"),
    ("keras.src.layers.layer", "Layer.add_loss",
     "per_thread_losses: a layer keeps the losses its call added in one list (_losses, "
     "an instance attribute), shared by tf.distribute's replica threads; they take "
     "turns at every all-reduce, and a layer run on the global batch (global_losses) "
     "all-gathers within the forward pass, so one replica's losses would be read, or "
     "cleared, by another"),
    ("keras.src.layers.layer", "Layer._get_own_losses", "same: what reads _losses"),
    ("keras.src.layers.layer", "Layer._clear_losses", "same: what clears it"),
    ("keras.src.utils.python_utils", "pythonify_logs",
     "metrics_logs: train_on_batch / test_on_batch under MirroredStrategy return the "
     "mean of each replica's own metric results, wrong when a batch splits unevenly; "
     "kmgpu reads the summed metric variables instead, formatted as Keras does"),
    ("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order", "same"),
    ("keras.src.trainers.trainer", "Trainer._get_metrics_result_or_logs",
     "replaced on replicas (synced_logs): it returns the metrics read across replicas "
     "only when the step's logs have their keys; a custom step that returns "
     "{m.name: m.result()} (keras.io's guide) nests CompileMetrics' results, so Keras "
     "returns the mean of each replica's own results, wrong when batches split unevenly"),
    ("keras.src.trainers.trainer", "Trainer.reset_metrics",
     "replaced on replicas whose metrics are all Keras's own (traced_reset_metrics): "
     "under tf.distribute each metric variable's reset is eager, an assign to every "
     "replica's copy and a read summed over them; train_on_batch resets at every call"),
    ("keras.src.trainers.trainer", "Trainer.get_metrics_result",
     "replaced on replicas (global_logs): inside a step each replica reads its own metric "
     "variables, and Keras's TF trainer hands on_train_batch_end the mean of the replicas' "
     "results, which differs from one device's when a batch splits unevenly (the loss "
     "tracker's counts then differ between replicas)"),
]


def train_step(self, data):
    """Keras's TensorFlow ``train_step`` with each replica's loss weighed by its part
    of the global batch's loss (``replica_loss``): one device's update, also for a
    partial last batch and for every loss reduction.
    """
    import tensorflow as tf
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        with global_batch.on_global(x):
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
        part = _track_loss(self, x, y, y_pred, sample_weight, True)
        loss = self.optimizer.scale_loss(part)
    if self.trainable_weights:
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def metrics_logs(model, return_dict):
    """``train_on_batch`` / ``test_on_batch``'s return value, from the metric variables
    read across replicas (summed), in Keras's format."""
    from keras.src.utils.python_utils import pythonify_logs

    logs = pythonify_logs(model.get_metrics_result())
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def test_step(self, data):
    """Keras's TensorFlow ``test_step``, its loss tracker updated as ``train_step``'s."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    with global_batch.on_global(x, training=False):
        y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
    _track_loss(self, x, y, y_pred, sample_weight, False)
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _track_loss(model, x, y, y_pred, sample_weight, training):
    """Update the loss tracker as one device's would be for the global batch; returns
    this replica's part of the global loss (``kmgpu.engines.keras_fixes.replica_loss``,
    Keras's 1/N scaling of means for tf.distribute undone)."""
    import tensorflow as tf

    from kmgpu.engines import keras_fixes as common

    context = tf.distribute.get_replica_context()
    rows = tf.cast(_rows(x), "float32")
    total = context.all_reduce("sum", rows)
    kind, local, part = common.replica_loss(
        model, x, y, y_pred, sample_weight, training, rows, total,
        lambda w: context.all_reduce("sum", w), keras_scale=context.num_replicas_in_sync)
    if kind == "none":  # a loss per row: what a Mean makes of it, without NaN for no rows
        local = tf.math.divide_no_nan(tf.reduce_sum(local), tf.cast(rows, local.dtype))
    value, _ = common.tracker_update(kind, local, part, tf.maximum(rows, 1.0), total)
    model._loss_tracker.update_state(value, sample_weight=rows)
    return part


class _PerThread(list):
    """A layer's list of added losses, one per thread (``per_thread_losses``)."""

    def __init__(self):
        super().__init__()
        self._local = threading.local()

    @property
    def _items(self):
        if not hasattr(self._local, "items"):
            self._local.items = []
        return self._local.items

    def extend(self, values):
        self._items.extend(values)

    def append(self, value):
        self._items.append(value)

    def clear(self):
        self._items.clear()

    def __getitem__(self, i):
        return self._items[i]

    def __delitem__(self, i):
        del self._items[i]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __bool__(self):
        return bool(self._items)


def per_thread_losses(model):
    """Each layer of ``model`` (a replica) keeps its added losses per thread: every
    replica thread reads and clears only its own (``PATCHES``)."""
    for layer in model._flatten_layers(include_self=True):
        if not isinstance(layer._losses, _PerThread):
            object.__setattr__(layer, "_losses", _PerThread())


def keeps_keras_step(model, step="train_step"):
    """True when ``model`` runs Keras's own TensorFlow ``step`` (not the user's)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(type(model), step) is getattr(TensorFlowTrainer, step)


# -- exact losses for custom train steps and per-output losses ---------------------------
def _rows(*structures):
    import keras
    import tensorflow as tf

    for s in structures:
        leaves = [t for t in keras.tree.flatten(s) if t is not None]
        if leaves:
            return tf.shape(leaves[0])[0]
    return None


def exact_custom_steps(model):
    """A model with its own ``train_step`` or ``test_step`` that calls Keras's
    ``compute_loss``: within that step ``compute_loss`` returns the one-device loss of the global batch's share
    (``mean_r * N * n_r / n``, whose mean over replicas is the global mean), with the
    gradient of ``mean_r * n_r / n``, which tf.distribute's summed gradients turn into
    the one-device gradient also for a partial last batch. A loss tracker fed with it
    then shows what one device shows.
    """
    import tensorflow as tf
    from keras.src.trainers.trainer import Trainer

    from kmgpu.engines import keras_fixes as common

    if type(model).compute_loss is not Trainer.compute_loss:
        return  # the user's own compute_loss: theirs to scale
    compute_loss, inside = model.compute_loss, []
    replicas = model.distribute_strategy.num_replicas_in_sync

    def exact_compute_loss(*args, **kwargs):
        named = dict(zip(("x", "y", "y_pred", "sample_weight"), args), **kwargs)
        rows = _rows(named.get("y_pred"), named.get("y"), named.get("x"))
        context = tf.distribute.get_replica_context()
        if not inside or rows is None or context is None or replicas == 1:
            return compute_loss(*args, **kwargs)
        rows = tf.cast(rows, "float32")
        exact = common.replica_loss(  # the rule of kmgpu.engines.keras_fixes
            model, named.get("x"), named.get("y"), named.get("y_pred"),
            named.get("sample_weight"), named.get("training", True), rows,
            context.all_reduce("sum", rows), lambda w: context.all_reduce("sum", w),
            keras_scale=replicas)[2]
        return exact + tf.stop_gradient(exact * (replicas - 1))

    def within(step, training):
        def run(data):
            import keras

            inside.append(True)
            try:
                x = keras.utils.unpack_x_y_sample_weight(data)[0]
                with global_batch.on_global(x, training):
                    return _global_step_logs(model, step(data))
            finally:
                inside.pop()
        return run

    model.compute_loss = exact_compute_loss
    for name in ("train_step", "test_step"):  # the user's own (keras.io's guide writes both)
        if not keeps_keras_step(model, name):
            setattr(model, name, within(getattr(model, name), name == "train_step"))


def weigh_output_losses(model):
    """Each output's loss tracker is updated with weight ``y_pred.shape[0]``, which is
    None in a traced step (so 1 per step on one device). Each replica weighs its update
    by its share ``n_r / n`` of the global batch instead, so the replicas together count
    as one device's step, also when a partial last batch splits unevenly.
    Needs the model's compile loss built (after the symbolic build).
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if (compile_loss is None or not compile_loss.built or not compile_loss.metrics
            or hasattr(compile_loss, "_kmgpu_share")):
        return  # no per-output trackers (one loss): no extra all-reduce per step
    import tensorflow as tf

    from kmgpu.engines import keras_fixes as common

    import threading

    local, call = threading.local(), compile_loss.call  # replicas trace in threads, and
    # meet at every all-reduce: one list of shares for all would hand one replica another's

    def weighed_call(y_true, y_pred, sample_weight=None):
        shares = local.__dict__.setdefault("shares", [])
        rows, context = _rows(y_pred), tf.distribute.get_replica_context()
        if rows is None or context is None or context.num_replicas_in_sync == 1 or \
                common.loss_kind(model) == "none":  # a loss per row: one device counts rows
            shares.append(None)
        else:  # rows here / rows in the global batch
            shares.append(tf.cast(rows, "float32") / tf.cast(context.all_reduce("sum", rows),
                                                             "float32"))
        try:
            return call(y_true, y_pred, sample_weight)
        finally:
            shares.pop()

    def weighed(update_state):
        def update(values, sample_weight=None):
            shares = getattr(local, "shares", None)
            if sample_weight is None and shares and shares[-1] is not None:
                sample_weight = shares[-1]
            return update_state(values, sample_weight=sample_weight)
        return update

    for metric in compile_loss.metrics:
        metric.update_state = weighed(metric.update_state)
    compile_loss.call, compile_loss._kmgpu_share = weighed_call, True


def global_logs(model):
    """Within a replica's step, ``get_metrics_result`` (what Keras's own steps and
    ``compute_metrics`` return) reads the metric variables summed over the replicas, in
    a ``merge_call``: every replica returns the one-device results of the global batches
    so far, so the per-batch logs callbacks get equal one device's, a partial last batch
    included. Custom steps that return ``m.result()`` themselves get the same
    (``exact_custom_steps``). Outside a step Keras's own reading applies."""
    import tensorflow as tf

    results = model.get_metrics_result

    def get_metrics_result():
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return results()
        return context.merge_call(lambda _: results())

    model.get_metrics_result = get_metrics_result


def traced_reset_metrics(model):
    """``model.reset_metrics`` runs as one traced function when every metric it resets is
    Keras's own (their ``reset_state`` only assigns their variables; a user's metric
    may keep Python state, which a traced function would reset once): one call instead
    of an eager assign and read per variable and replica."""
    import tensorflow as tf
    from keras.src.trainers.trainer import Trainer

    def keras_own(metric):
        return type(metric).__module__.startswith("keras.") and all(
            keras_own(m) for m in getattr(metric, "metrics", ()) or () if m is not None)

    if type(model).reset_metrics is not Trainer.reset_metrics:
        return
    reset, traced = model.reset_metrics, {}

    def reset_metrics():
        if not all(keras_own(m) for m in model.metrics):
            return reset()
        key = tuple(id(v) for v in model.metrics_variables)  # a metric built since: anew
        if traced.get("key") != key:
            traced.update(key=key, fn=tf.function(reset, autograph=False))
        return traced["fn"]()

    model.reset_metrics = reset_metrics


def _global_step_logs(model, logs):
    """A custom step's logs, read across replicas (``global_logs``) when they are the
    metrics' results (the keys test of ``synced_logs``)."""
    if not isinstance(logs, dict):
        return logs
    keys = set()
    for key, value in logs.items():
        keys.update(value) if isinstance(value, dict) else keys.add(key)
    merged = model.get_metrics_result()
    return merged if set(merged) == keys else logs


def synced_logs(model):
    """fit / evaluate report the metrics read across replicas (summed) also when a custom
    step returns them nested, as ``{m.name: m.result() for m in self.metrics}`` does for
    the compiled metrics: Keras compares the step's keys with the flat metric names and
    otherwise reports the mean of the replicas' own results."""
    original = model._get_metrics_result_or_logs

    def get_metrics_result_or_logs(logs):
        if isinstance(logs, dict):
            keys = set()
            for key, value in logs.items():
                keys.update(value) if isinstance(value, dict) else keys.add(key)
            metric_logs = model.get_metrics_result()
            if keys == set(metric_logs):
                return metric_logs
        return original(logs)

    model._get_metrics_result_or_logs = get_metrics_result_or_logs

"""The TensorFlow engine's train and test steps under tf.distribute: each replica's loss
weighed by its part of the global batch (``train_step``, ``test_step``, custom steps,
per-output loss trackers), the metrics read across replicas, Keras's symbolic build from
a batch it can split, and its multi-worker reduction of step outputs. Rows of
``kmgpu/engines/tensorflow/keras_fixes.py``.
"""

import functools
import threading
import types

from kmgpu.engines import keras_fixes, loss_fixes
from kmgpu.engines.tensorflow import batch_gather, optimizer_fixes


def reduce_fix(strategy):
    """Keras 3.15's TF trainer reduces multi-worker step outputs with
    ``strategy.reduce("MEAN", v, axis=0)``, which fails on scalar metrics
    ("Invalid reduction dimension 0 for input with 0 dimensions", keras #20585).
    Within the block, a mean over all replicas (``axis=None``) is used instead.
    """
    import keras
    from keras.src.backend.tensorflow import trainer

    def mean_over_replicas(original):
        def reduce_per_replica(values, strategy, reduction):
            if reduction in ("auto", "mean") and \
                    trainer._collective_all_reduce_multi_worker(strategy):
                return keras.tree.map_structure(
                    lambda v: strategy.reduce("MEAN", v, axis=None), values)
            return original(values, strategy, reduction)
        return reduce_per_replica

    return keras_fixes.swapped((trainer, "reduce_per_replica", mean_over_replicas))


def symbolic_build(self, iterator=None, data_batch=None, feed=None, replica_fixes=True):
    """Keras builds metrics and optimizer from the first batch, averaged over replicas,
    which fails when the first batch splits unevenly. Only its shapes matter, so
    build from the first batch kmgpu already read from a generator (``feed``), or
    from the first replica's rows of the first batch of the data's own
    undistributed ``tf.data`` pipeline.
    Keras pulls one from a new distributed iterator and drops it at once
    (``EpochIterator.reset``): destroying a multi-device iterator whose prefetch
    has just started crashed the process now and then (SIGSEGV / SIGABRT in
    ``reset``, 1 in ~4 suite runs), so kmgpu only does that for data it cannot
    read otherwise (a user's own DistributedDataset). The optimizer needs no
    batch. Then, unless ``replica_fixes`` is false (one replica), install the replica
    fixes that need the compiled parts built (per-output loss weights, gradient
    accumulation).
    """
    needs_batch = (not all(layer.built for layer in self._flatten_layers())
                   or any(part is not None and not part.built for part in
                          (getattr(self, name, None) for name in  # none if never compiled
                           ("_compile_metrics", "_compile_loss"))))
    optimizer = getattr(self, "optimizer", None)
    if needs_batch or (optimizer is not None and not optimizer.built):
        if not needs_batch:
            data_batch = None
        elif data_batch is None and feed and feed.get("first") is not None:
            data_batch = _replica_rows(self.distribute_strategy, feed["first"])
        elif data_batch is None and iterator is not None:
            data_batch = _first_batch(self.distribute_strategy, iterator)
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)
    if not replica_fixes:
        return
    weigh_output_losses(self)
    if optimizer is not None:
        optimizer_fixes.accumulate_across_replicas(optimizer)
        optimizer_fixes.reduce_before_clipping(optimizer)
        optimizer_fixes.finite_over_replicas(optimizer)


def _first_batch(strategy, iterator):
    """The first batch of an epoch iterator's data, for its shapes only."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters import array_data_adapter, tf_dataset_adapter

    adapter = iterator.data_adapter
    if isinstance(adapter, (array_data_adapter.ArrayDataAdapter,
                            tf_dataset_adapter.TFDatasetAdapter)):
        dataset = adapter.get_tf_dataset()
        if isinstance(dataset, tf.data.Dataset):
            return _replica_rows(strategy, next(iter(dataset.take(1))))
    for _, _, it in iterator:
        return strategy.experimental_local_results(next(it))[0]


def _replica_rows(strategy, batch):
    """The first replica's rows of a global ``batch``, as tf.distribute (ceil) and
    kmgpu's own feed (even) both hand them: a stateful RNN is built for its replica's
    batch size."""
    import tensorflow as tf

    rows = tf.nest.flatten(batch)[0].shape[0]
    if rows is None:
        return batch
    first = -(-rows // strategy.num_replicas_in_sync)
    return tf.nest.map_structure(
        lambda t: t[:first] if getattr(t, "shape", None) is not None and len(t.shape)
        else t, batch)


def train_step(self, data):
    """Keras's TensorFlow ``train_step`` with each replica's loss weighed by its part
    of the global batch's loss (``replica_loss``): one device's update, also for a
    partial last batch and for every loss reduction.
    """
    import tensorflow as tf
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        with batch_gather.on_global(x):
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
    with batch_gather.on_global(x, training=False):
        y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
    _track_loss(self, x, y, y_pred, sample_weight, False)
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _track_loss(model, x, y, y_pred, sample_weight, training):
    """Update the loss tracker as one device's would be for the global batch; returns
    this replica's part of the global loss (``kmgpu.engines.loss_fixes.replica_loss``,
    Keras's 1/N scaling of means for tf.distribute undone)."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    rows = tf.cast(_rows(x), "float32")
    total = context.all_reduce("sum", rows)
    kind, local, part = loss_fixes.replica_loss(
        model, x, y, y_pred, sample_weight, training, rows, total,
        lambda w: context.all_reduce("sum", w), keras_scale=context.num_replicas_in_sync)
    if kind == "none":  # a loss per row: what a Mean makes of it, without NaN for no rows
        local = tf.math.divide_no_nan(tf.reduce_sum(local), tf.cast(rows, local.dtype))
    value, _ = loss_fixes.tracker_update(kind, local, part, tf.maximum(rows, 1.0), total)
    model._loss_tracker.update_state(value, sample_weight=rows)
    return part


def own_build(replica, feed, replica_fixes):
    """A replica's ``_maybe_symbolic_build`` becomes ``symbolic_build`` (above), on every
    replica count: Keras's own build reads a throwaway distributed iterator."""
    keras_fixes.install(replica, "_maybe_symbolic_build", lambda keras_own: functools.partial(
        symbolic_build, replica, feed=feed, replica_fixes=replica_fixes))


def replica_steps(replica, template):
    """kmgpu's ``train_step`` and ``test_step`` (above) on a replica whose template keeps
    Keras's own (the test step for a masked mean too)."""
    for name, step in (("train_step", train_step), ("test_step", test_step)):
        if keeps_keras_step(template, name):
            keras_fixes.install(replica, name,
                                lambda keras_own, step=step: types.MethodType(step, replica))


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
    ``compute_loss``: within that step ``compute_loss`` returns the one-device loss of
    the global batch's share (``mean_r * N * n_r / n``, whose mean over replicas is the
    global mean), with the
    gradient of ``mean_r * n_r / n``, which tf.distribute's summed gradients turn into
    the one-device gradient also for a partial last batch. A loss tracker fed with it
    then shows what one device shows.
    """
    import tensorflow as tf
    from keras.src.trainers.trainer import Trainer

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
        exact = loss_fixes.replica_loss(  # the rule every engine weighs a replica by
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
                with batch_gather.on_global(x, training):
                    return _global_step_logs(model, step(data))
            finally:
                inside.pop()
        return run

    keras_fixes.install(model, "compute_loss", lambda keras_own: exact_compute_loss)
    for name in ("train_step", "test_step"):  # the user's own (keras.io's guide writes both)
        if not keeps_keras_step(model, name):
            keras_fixes.install(model, name,
                                lambda step, training=name == "train_step": within(step, training))


def weigh_output_losses(model):
    """Each output's loss tracker is updated with weight ``y_pred.shape[0]``, which is
    None in a traced step (so 1 per step on one device). Each replica weighs its update
    by its share ``n_r / n`` of the global batch instead, so the replicas together count
    as one device's step, also when a partial last batch splits unevenly.
    Needs the model's compile loss built (after the symbolic build).
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None or not compile_loss.built or not compile_loss.metrics:
        return  # no per-output trackers (one loss): no extra all-reduce per step
    import tensorflow as tf

    local = threading.local()  # replicas trace in threads, and meet at every
    # all-reduce: one list of shares for all would hand one replica another's

    def sharing(call):
        def weighed_call(y_true, y_pred, sample_weight=None):
            shares = local.__dict__.setdefault("shares", [])
            rows, context = _rows(y_pred), tf.distribute.get_replica_context()
            if rows is None or context is None or context.num_replicas_in_sync == 1 or \
                    loss_fixes.loss_kind(model) == "none":  # a loss per row: rows count
                shares.append(None)
            else:  # rows here / rows in the global batch
                shares.append(tf.cast(rows, "float32") / tf.cast(
                    context.all_reduce("sum", rows), "float32"))
            try:
                return call(y_true, y_pred, sample_weight)
            finally:
                shares.pop()
        return weighed_call

    def weighed(update_state):
        def update(values, sample_weight=None):
            shares = getattr(local, "shares", None)
            if sample_weight is None and shares and shares[-1] is not None:
                sample_weight = shares[-1]
            return update_state(values, sample_weight=sample_weight)
        return update

    if keras_fixes.install(compile_loss, "call", sharing, key="weigh_output_losses"):
        for metric in compile_loss.metrics:
            keras_fixes.install(metric, "update_state", weighed)


def global_logs(model):
    """Within a replica's step, ``get_metrics_result`` (what Keras's own steps and
    ``compute_metrics`` return) reads the metric variables summed over the replicas, in
    a ``merge_call``: every replica returns the one-device results of the global batches
    so far, so the per-batch logs callbacks get equal one device's, a partial last batch
    included. Custom steps that return ``m.result()`` themselves get the same
    (``exact_custom_steps``). Outside a step Keras's own reading applies."""
    import tensorflow as tf

    def across_replicas(results):
        def get_metrics_result():
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return results()
            return context.merge_call(lambda _: results())
        return get_metrics_result

    keras_fixes.install(model, "get_metrics_result", across_replicas)


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
    traced = {}

    def traced_reset(reset):
        def reset_metrics():
            if not all(keras_own(m) for m in model.metrics):
                return reset()
            key = tuple(id(v) for v in model.metrics_variables)  # a metric built since: anew
            if traced.get("key") != key:
                traced.update(key=key, fn=tf.function(reset, autograph=False))
            return traced["fn"]()
        return reset_metrics

    keras_fixes.install(model, "reset_metrics", traced_reset)


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
    def summed_if_metrics(original):
        def get_metrics_result_or_logs(logs):
            if isinstance(logs, dict):
                keys = set()
                for key, value in logs.items():
                    keys.update(value) if isinstance(value, dict) else keys.add(key)
                metric_logs = model.get_metrics_result()
                if keys == set(metric_logs):
                    return metric_logs
            return original(logs)
        return get_metrics_result_or_logs

    keras_fixes.install(model, "_get_metrics_result_or_logs", summed_if_metrics)

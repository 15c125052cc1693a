"""Keras internals the TensorFlow engine uses or replaces, in one place.

Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
``tests/unit/test_structure.py`` checks every name still exists.
"""

import contextlib

from kmgpu.engines.tensorflow import iterator_keras_fixes, step_keras_fixes
from kmgpu.engines.tensorflow.iterator_keras_fixes import (  # noqa: F401 (the engine's names)
    park_iterators, untuned_iterators)
from kmgpu.engines.tensorflow.step_keras_fixes import (  # noqa: F401 (the engine's names)
    exact_custom_steps, global_logs, keeps_keras_step, metrics_logs, per_thread_losses, synced_logs,
    test_step, traced_reset_metrics, train_step, weigh_output_losses)

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why): this module's, then
#: ``step_keras_fixes``'s (the train and test steps) and ``iterator_keras_fixes``'s (the
#: distributed iterators' lives)
PATCHES = [
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica",
     "replaced during multi-worker calls: it reduces scalar metrics with axis=0, which "
     "fails (\"Invalid reduction dimension 0\", keras-team/keras#20585)"),
    ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker",
     "read by the replacement above"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._symbolic_build",
     "symbolic_build below calls it on the first batch of the undistributed data: "
     "Keras averages the first batch over replicas, which fails when it splits unevenly, "
     "and drops the new distributed iterator it read it from at once, which now and then "
     "crashed the process (SIGSEGV in EpochIterator.reset)"),
    ("keras.src.trainers.data_adapters.tf_dataset_adapter", "TFDatasetAdapter",
     "same: its get_tf_dataset() is the undistributed data"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter",
     "fit on arrays fed as one repeating tf.data pipeline: Keras makes a new distributed "
     "iterator every epoch for arrays (~0.4 s per epoch under MirroredStrategy)"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays", "same"),
    ("tensorflow.python.eager.context", "global_seed",
     "read by first_pass_order: under a global seed Keras's array pipeline reads the same "
     "shuffled permutation every epoch (a new iterator restarts its stateful shuffle), "
     "which the repeating pipeline would not"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split", "same"),
    ("keras.src.trainers.data_adapters.data_adapter_utils", "unpack_x_y_sample_weight",
     "same, and the weighted train_step"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply",
     "replaced on replica optimizers with gradient_accumulation_steps, or use_ema with "
     "ema_overwrite_frequency (accumulate_across_replicas): under tf.distribute it fails "
     "with merge_call inside its Cond (keras-team/keras#17429)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._clip_gradients",
     "replaced on replica optimizers that clip (reduce_before_clipping): Keras clips "
     "each replica's gradient before the all-reduce, so global_clipnorm, clipnorm and "
     "clipvalue see 1/N of the batch (4 replicas: 0.18 relative from one device)"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer._all_reduce_sum_gradients",
     "same: skipped for gradients already summed before clipping"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments",
     "replaced on replica BatchNorm layers with sync_batchnorm (synced_moments): Keras's "
     "synchronized moments take 3 all-reduces per layer and var = E[x^2] - E[x]^2, "
     "which loses float32 digits that one device's two-pass tf.nn.moments keeps"),
    ("tensorflow.python.ops.custom_gradient", "_graph_mode_decorator",
     "wrapped during calls (all_reduce_without_walk): tracing a replica's all_reduce "
     "walks the graph back from its merged output, which reaches every replica's whole "
     "graph, to find variables it cannot use; per all-reduce, so synchronized "
     "BatchNorm traced in time quadratic in depth (MobileNetV2: over 400 s)"),
    ("tensorflow.python.ops.custom_gradient", "_get_dependent_variables", "same"),
    ("tensorflow.python.distribute.distribute_lib", "ReplicaContextBase.all_reduce",
     "its grad_wrapper is what all_reduce_without_walk recognises"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer._tf_apply",
     "replaced on replica loss-scale optimizers (finite_over_replicas): it takes \"the "
     "gradients are finite\" from the first replica's gradients, before they are summed, "
     "so another replica's overflow is applied as inf (NaN weights from then on)"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer.check_finite",
     "same: each replica's flag is all-reduced"),
    ("keras.src.optimizers.loss_scale_optimizer",
     "LossScaleOptimizer._stateful_handle_finite_grads", "called as Keras's _tf_apply does"),
    ("keras.src.optimizers.loss_scale_optimizer",
     "LossScaleOptimizer._stateful_handle_non_finite_grads", "same"),
    ("tensorflow", "__internal__.distribute.interim.maybe_merge_call",
     "made a direct call in cross-replica context while accumulate_across_replicas runs "
     "the optimizer's apply there (it would ask a missing replica context to merge)"),
] + step_keras_fixes.PATCHES + iterator_keras_fixes.PATCHES


@contextlib.contextmanager
def reduce_fix(strategy):
    """Keras 3.15's TF trainer reduces multi-worker step outputs with
    ``strategy.reduce("MEAN", v, axis=0)``, which fails on scalar metrics
    ("Invalid reduction dimension 0 for input with 0 dimensions", keras #20585).
    Within the block, a mean over all replicas (``axis=None``) is used instead.
    """
    import keras
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(
                strategy):
            return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica
    try:
        yield
    finally:
        trainer.reduce_per_replica = original


def synced_moments(layer):
    """BatchNorm moments over the global batch, as one device computes them
    (``tf.nn.moments``: the mean, then the mean squared difference from it), in two
    all-reduces per layer: [sum, count], then the sum of squared differences.
    Masked calls and calls outside a multi-replica step keep Keras's own.
    """
    import tensorflow as tf

    moments = layer._moments

    def two_pass(inputs, mask):
        context = tf.distribute.get_replica_context()
        if mask is not None or context is None or context.num_replicas_in_sync == 1:
            return moments(inputs, mask)
        axes = list(layer._reduction_axes)
        x = tf.cast(inputs, "float32") if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        local = tf.reduce_sum(x, axes, keepdims=True)
        count = tf.cast(tf.size(x) // tf.size(local), x.dtype)
        total = context.all_reduce("sum", tf.concat([tf.reshape(local, [-1]), [count]], 0))
        rows = total[-1]
        mean = tf.math.divide_no_nan(tf.reshape(total[:-1], tf.shape(local)), rows)
        squares = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axes,
                                keepdims=True)
        variance = tf.math.divide_no_nan(context.all_reduce("sum", squares), rows)
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    layer._moments = two_pass


@contextlib.contextmanager
def all_reduce_without_walk():
    """Within the block, tracing ``ReplicaContext.all_reduce`` skips TensorFlow's search
    for variables used inside its custom gradient (it uses none). Under MirroredStrategy
    that search walks back from the merged output through every replica's graph, once
    per all-reduce in the forward and the backward pass: synchronized BatchNorm then
    traces in time quadratic in the number of layers.
    """
    import threading

    from tensorflow.python.ops import custom_gradient

    decorate, dependent = custom_gradient._graph_mode_decorator, \
        custom_gradient._get_dependent_variables
    local = threading.local()  # replica threads trace concurrently

    def graph_mode_decorator(f, args, kwargs):
        name = getattr(f, "__qualname__", "")
        if not (name.startswith("ReplicaContext") and ".all_reduce.<locals>." in name):
            return decorate(f, args, kwargs)
        local.depth = getattr(local, "depth", 0) + 1
        try:
            return decorate(f, args, kwargs)
        finally:
            local.depth -= 1

    def get_dependent_variables(input_ops, output_ops):
        if getattr(local, "depth", 0):
            return []
        return dependent(input_ops, output_ops)

    custom_gradient._graph_mode_decorator = graph_mode_decorator
    custom_gradient._get_dependent_variables = get_dependent_variables
    try:
        yield
    finally:
        custom_gradient._graph_mode_decorator = decorate
        custom_gradient._get_dependent_variables = dependent


def first_pass_order(arrays, batch_size, shuffle):
    """Under a global seed, the rows of every epoch of Keras's own shuffled fit; else None.

    Keras 3.15.1 shuffles arrays inside its ``tf.data`` pipeline (``tf.random.shuffle``
    in a dataset function, or per batch for ``shuffle="batch"``) and reads a new
    iterator of that pipeline each epoch. A stateful random op in a dataset function
    starts again with each iterator, so under ``keras.utils.set_random_seed`` every epoch
    (and every ``fit`` call) reads the same permutation. The one repeating pipeline of
    ``repeating_datasets`` would go on drawing new ones: its first epoch only would be
    one device's. So the pass is read here from Keras's own pipeline over the row
    indices, and the arrays are fed in that order, unshuffled. Without a global seed
    each epoch draws anew on both sides, and nothing changes. NumPy arrays only (they
    are copied in that order); other array types keep Keras's pipeline.
    """
    import keras
    import numpy as np
    from keras.src.trainers.data_adapters import array_data_adapter
    from tensorflow.python.eager import context

    leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
    if (not shuffle or context.global_seed() is None or not leaves
            or not all(isinstance(a, np.ndarray) for a in leaves)):
        return None
    key = (context.global_seed(), len(leaves[0]), batch_size, shuffle)
    if key not in _ORDERS:  # a function of the key alone (the pipeline's op seeds are
        # fixed by its graph): read once, not at every call
        _ORDERS.clear()
        indices = array_data_adapter.ArrayDataAdapter(
            np.arange(len(leaves[0])), batch_size=batch_size, shuffle=shuffle)
        _ORDERS[key] = np.concatenate([np.asarray(b).reshape(-1)
                                       for b in indices.get_tf_dataset()])
    return _ORDERS[key]


_ORDERS = {}  # first_pass_order's last pass: (global seed, rows, batch size, shuffle) -> order


def repeating_datasets(kwargs, kept=None):
    """fit() on arrays, fed as repeating ``tf.data`` pipelines with known steps.

    For arrays Keras makes a new distributed iterator every epoch, which costs
    MirroredStrategy ~0.4 s per epoch on 4 devices, and one more at the end of the
    last epoch, never used (``EpochIterator._enumerate_iterator`` makes the next
    epoch's iterator when an epoch ends): fit(epochs=1) makes two. Given ``steps_per_epoch`` and
    a repeating dataset, Keras keeps one iterator for the whole fit. The dataset
    is Keras's own (``ArrayDataAdapter``): the same batches, the same per-epoch
    shuffling, class weights and partial last batch; each epoch reads exactly
    one pass. Validation arrays get the same treatment with ``validation_steps``.
    With ``kept`` (a ``kept_input.KeptInput``), the training pipeline, distributed, and
    its iterator are those of an earlier call where that changes no batch.
    """
    import keras
    from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
    from keras.src.trainers.data_adapters import data_adapter_utils

    def arrays(*data):
        return array_data_adapter.can_convert_arrays(data) and data[0] is not None

    kw = dict(kwargs)
    x, y, weights = kw.get("x"), kw.get("y"), kw.get("sample_weight")
    if kw.get("steps_per_epoch") is not None or not arrays(x, y, weights):
        return kwargs
    if kw.get("validation_split") and kw.get("validation_data") is None:
        (x, y, weights), kw["validation_data"] = array_slicing.train_validation_split(
            (x, y, weights), validation_split=kw["validation_split"])
    kw["validation_split"] = 0.0
    batch_size, shuffle, class_weight = (kw.get("batch_size") or 32, kw.get("shuffle", True),
                                         kw.get("class_weight"))
    order = first_pass_order((x, y, weights), batch_size, shuffle)
    if order is not None:  # every epoch reads that pass, as on one device
        x, y, weights = keras.tree.map_structure(
            lambda a: None if a is None else a[order], (x, y, weights), none_is_leaf=True)
        shuffle = False

    def build(x, y, weights):
        train = array_data_adapter.ArrayDataAdapter(
            x, y, sample_weight=weights, batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight)
        return train.get_tf_dataset().repeat(), train.num_batches

    made = None if kept is None else kept.dataset(
        (x, y, weights), shuffle,
        (batch_size, shuffle, None if class_weight is None else dict(class_weight)), build)
    dataset, steps = made or build(x, y, weights)
    kw.update(x=dataset, y=None, sample_weight=None, shuffle=False, class_weight=None,
              batch_size=None, steps_per_epoch=steps)
    validation = kw.get("validation_data")
    if validation is not None and kw.get("validation_steps") is None:
        vx, vy, vw = data_adapter_utils.unpack_x_y_sample_weight(validation)
        if arrays(vx, vy, vw):
            val = array_data_adapter.ArrayDataAdapter(
                vx, vy, sample_weight=vw,
                batch_size=kw.get("validation_batch_size") or batch_size)
            kw.update(validation_data=val.get_tf_dataset().repeat(),
                      validation_steps=val.num_batches, validation_batch_size=None)
    return kw


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
        accumulate_across_replicas(optimizer)
        reduce_before_clipping(optimizer)
        finite_over_replicas(optimizer)


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


def accumulate_across_replicas(optimizer):
    """``gradient_accumulation_steps`` under tf.distribute: Keras applies or accumulates
    in a ``cond`` whose update branch needs a ``merge_call``, which tf.distribute refuses
    (keras-team/keras#17429); so does ``use_ema`` with ``ema_overwrite_frequency`` (a
    ``cond`` that overwrites the variables with their averages). The replicas' gradients are summed here instead (the same
    all-reduce Keras does) and the optimizer's own ``apply`` runs once, in cross-replica
    context, where its ``cond`` holds only plain per-device updates.
    """
    import tensorflow as tf

    ema_overwrite = optimizer.use_ema and optimizer.ema_overwrite_frequency
    if not (optimizer.gradient_accumulation_steps or ema_overwrite) or hasattr(
            optimizer, "_kmgpu_apply"):
        return
    apply = optimizer.apply

    def apply_once(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return apply(grads, trainable_variables)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i, g in zip(present, context.all_reduce("sum", [grads[i] for i in present])):
            grads[i] = g

        def merged(strategy, grads):
            first = [None if g is None else strategy.experimental_local_results(g)[0]
                     for g in grads]
            interim = tf.__internal__.distribute.interim
            original = interim.maybe_merge_call

            def maybe_merge_call(fn, strategy, *args, **kwargs):
                if tf.distribute.in_cross_replica_context():  # already merged: call it
                    return fn(strategy, *args, **kwargs)
                return original(fn, strategy, *args, **kwargs)

            interim.maybe_merge_call = maybe_merge_call  # while Keras's cond is traced
            try:
                return apply(first, trainable_variables)
            finally:
                interim.maybe_merge_call = original

        return context.merge_call(merged, args=(grads,))

    optimizer.apply, optimizer._kmgpu_apply = apply_once, True


def reduce_before_clipping(optimizer):
    """An optimizer that clips (``global_clipnorm``, ``clipnorm``, ``clipvalue``) clips
    the summed gradient of all replicas, as one device clips its batch's gradient:
    within a replica the gradients are all-reduced first, then clipped, and Keras's
    own all-reduce after clipping is skipped for them.
    """
    import threading

    import tensorflow as tf

    if not (optimizer.global_clipnorm or optimizer.clipnorm or optimizer.clipvalue) \
            or hasattr(optimizer, "_kmgpu_clip"):
        return
    clip, all_reduce, reduced = optimizer._clip_gradients, \
        optimizer._all_reduce_sum_gradients, threading.local()  # replicas trace in threads

    def clip_summed(grads):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return clip(grads)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i, g in zip(present, context.all_reduce("sum", [grads[i] for i in present])):
            grads[i] = g
        reduced.done = True
        return clip(grads)

    def all_reduce_once(grads_and_vars):
        if getattr(reduced, "done", False):
            reduced.done = False
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)

    optimizer._clip_gradients, optimizer._all_reduce_sum_gradients = clip_summed, \
        all_reduce_once
    optimizer._kmgpu_clip = True


def finite_over_replicas(optimizer):
    """A ``LossScaleOptimizer`` (``mixed_float16``) applies the update only when the
    gradients of every replica are finite, and halves its scale otherwise, as one device
    decides from its whole batch's gradient: each replica's "finite" flag is all-reduced
    (Keras takes the first replica's flag, before the gradients are summed).
    """
    import tensorflow as tf
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    if not isinstance(optimizer, LossScaleOptimizer) or hasattr(optimizer, "_kmgpu_finite"):
        return
    check, tf_apply = optimizer.check_finite, optimizer._tf_apply

    def check_finite(grads):
        finite = check(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce("sum", 1.0 - tf.cast(finite, "float32"))
        return tf.equal(overflowed, 0.0)

    def apply_if_finite(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1 or \
                tf.__internal__.distribute.strategy_supports_no_merge_call():
            return tf_apply(grads, trainable_variables)  # its check_finite is the one above
        finite = check_finite(grads)  # the same on every replica

        def cross_replica(strategy, grads, trainable_variables, finite):
            def apply():
                strategy.extended.call_for_each_replica(
                    optimizer._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # a cond in cross-replica context, as Keras's (a branch merges)
            tf.cond(strategy.experimental_local_results(finite)[0], apply,
                    optimizer._stateful_handle_non_finite_grads)

        context.merge_call(cross_replica, args=(grads, trainable_variables, finite))

    optimizer.check_finite, optimizer._tf_apply = check_finite, apply_if_finite
    optimizer._kmgpu_finite = True

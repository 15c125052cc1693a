"""Keras layers under tf.distribute: BatchNormalization's synchronized moments as one
device computes them and traced in time linear in depth, and the losses a layer adds
kept per replica thread. Rows of ``kmgpu/engines/tensorflow/keras_fixes.py``.
"""

import threading

from kmgpu.engines import keras_fixes


def synced_moments(layer):
    """BatchNorm moments over the global batch, as one device computes them
    (``tf.nn.moments``: the mean, then the mean squared difference from it), in two
    all-reduces per layer: [sum, count], then the sum of squared differences.
    Masked calls and calls outside a multi-replica step keep Keras's own.
    """
    keras_fixes.install(layer, "_moments", lambda moments: _two_pass(layer, moments))


def _two_pass(layer, moments):
    """``synced_moments``' moments for ``layer``; Keras's own ``moments`` where it keeps them."""
    import tensorflow as tf

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

    return two_pass


def all_reduce_without_walk():
    """Within the block, tracing ``ReplicaContext.all_reduce`` skips TensorFlow's search
    for variables used inside its custom gradient (it uses none). Under MirroredStrategy
    that search walks back from the merged output through every replica's graph, once
    per all-reduce in the forward and the backward pass: synchronized BatchNorm then
    traces in time quadratic in the number of layers.
    """
    from tensorflow.python.ops import custom_gradient

    local = threading.local()  # replica threads trace concurrently

    def marking(decorate):
        def graph_mode_decorator(f, args, kwargs):
            name = getattr(f, "__qualname__", "")
            if not (name.startswith("ReplicaContext") and ".all_reduce.<locals>." in name):
                return decorate(f, args, kwargs)
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return decorate(f, args, kwargs)
            finally:
                local.depth -= 1
        return graph_mode_decorator

    def skipping(dependent):
        def get_dependent_variables(input_ops, output_ops):
            if getattr(local, "depth", 0):
                return []
            return dependent(input_ops, output_ops)
        return get_dependent_variables

    return keras_fixes.swapped((custom_gradient, "_graph_mode_decorator", marking),
                               (custom_gradient, "_get_dependent_variables", skipping))


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
        keras_fixes.install(layer, "_losses", lambda shared: _PerThread(),
                            key="per_thread_losses")

"""Keras layers on JAX replicas: BatchNormalization with each replica's own moments
(``sync_batchnorm=False``), stateful RNN states carried through the jitted steps, and
the template's rematerialization (``keras.RematScope``).
Rows of ``kmgpu/engines/jax/keras_fixes.py``.
"""

import functools

from kmgpu.engines import keras_fixes


def local_batchnorm(replica, distribution):
    """Give each BatchNormalization of ``replica`` per-replica moments in training.

    Replaces ``call`` on each layer instance (``kmgpu.engines.jax.batchnorm``). The
    original ``call`` still runs where local moments do not apply: inference
    (``training=False`` or a frozen layer: moving statistics, as always), a batch the
    device count does not divide (kmgpu places it replicated, each device holds the
    whole batch, so the moments over the whole batch are local too), ``axis=0``.

    Layers left with global moments (their names are returned): a subclass that
    overrides ``call``, ``renorm=True``, ``synchronized=True``.

    Returns:
        (local, kept): the numbers of layers given local moments, and the names of
        the BatchNormalization layers that keep Keras's own (global) moments.
    """
    import keras

    mesh = distribution.device_mesh.backend_mesh
    axis_name = distribution.batch_dim_name
    n = mesh.shape[axis_name]
    bn = keras.layers.BatchNormalization
    local, kept = 0, []
    for layer in replica._flatten_layers():
        if not isinstance(layer, bn):
            continue
        if type(layer).call is not bn.call or layer.renorm or layer.synchronized:
            kept.append(layer.name)
            continue
        keras_fixes.install(layer, "call", functools.partial(
            _local_moments, layer, mesh=mesh, axis_name=axis_name, n=n))
        local += 1
    return local, kept


def _local_moments(layer, original, mesh, axis_name, n):
    """``local_batchnorm``'s ``call`` for ``layer``, bound to it (``original``: the
    layer's own call, where local moments do not apply)."""
    import types

    from kmgpu.engines.jax import batchnorm

    def call(self, inputs, training=None, mask=None):
        batch = inputs.shape[0]
        if (not (training and self.trainable) or batch is None or batch % n
                or self.axis % len(inputs.shape) == 0
                or (mask is not None and len(mask.shape) != len(inputs.shape) - 1)):
            return original(inputs, training=training, mask=mask)
        outputs, mean, variance = batchnorm.normalize(self, inputs, mask, mesh, axis_name)
        batchnorm.update_moving(self, mean, variance)
        return outputs

    return types.MethodType(call, layer)


def track_states(replica, distribution):
    """Stateful RNN states join the model's non-trainable variables, sharded by rows.

    Keras 3.15.1's JAX trainer carries only tracked variables through its jitted
    steps, and RNN states are created untracked, so ``fit``/``predict`` carry no
    state at all (an untracked state is a constant of the traced step). Tracked,
    they travel with the BatchNorm statistics; laid out along the batch axis,
    device r keeps rows r*B/N ... (r+1)*B/N - 1, as its data shard. Uses the
    layer's private ``_tracker`` / ``_track_variable`` and the variable's ``_layout``.
    """
    import keras

    from kmgpu.engines import replication

    d = distribution
    for layer in replication.stateful_layers(replica):
        locked = layer._tracker.locked
        layer._tracker.unlock()
        for v in keras.tree.flatten(layer.states):
            layer._track_variable(v)
            v._layout = keras.distribution.TensorLayout(
                [d.batch_dim_name] + [None] * (len(v.shape) - 1), d.device_mesh)
            v.assign(v.value)
        if locked:
            layer._tracker.lock()


def keep_remat(replica, template):
    """Each layer of ``replica`` rematerializes as the template's layer in its place does.

    A layer takes its remat mode (``keras.RematScope``) when it is made, into its
    ``_remat_mode``, and reads it at every call; the replica is made from the template
    outside the user's scope, so its layers would have none and the step would keep
    every activation for the backward pass. Layers are paired in ``_flatten_layers``
    order (the replica is the template's copy); nothing is done if the counts differ.
    """
    layers = list(template._flatten_layers(include_self=True))
    copies = list(replica._flatten_layers(include_self=True))
    if len(layers) != len(copies):
        return
    for layer, copy in zip(layers, copies):
        mode = getattr(layer, "_remat_mode", None)
        if mode is not None and getattr(copy, "_remat_mode", None) is None:
            copy._remat_mode = mode

"""Keras's JAX train, test and predict steps on replicas: predictions every process can
read, and each trace's own loss ids. Rows of ``kmgpu/engines/jax/keras_fixes.py``.
"""

from kmgpu.engines import keras_fixes


def replicated_predictions(replica, mesh):
    """Make ``predict`` outputs replicated, so every process can read all rows
    (a batch-sharded output spans other processes' devices)."""
    import types

    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())

    def replicating(step):
        def predict_step(self, state, data):  # Keras's JAX trainer: (outputs, state)
            outputs, non_trainable = step(state, data)
            return keras.tree.map_structure(
                lambda t: jax.lax.with_sharding_constraint(t, replicated),
                outputs), non_trainable
        return types.MethodType(predict_step, replica)

    keras_fixes.install(replica, "predict_step", replicating)


def fresh_loss_ids(model):
    """Each trace of ``model``'s step starts with no loss ids left from an earlier trace.

    Inside a traced step a layer's ``add_loss`` records the loss's ``id()`` in the layer's
    ``_loss_ids``, which outlives the trace; the loss itself does not. A later trace (a
    new batch shape, e.g. a last partial batch) makes new losses that may reuse such an
    address: a layer's ``_clear_losses`` (run as its call begins) then removes another
    layer's loss from the step, or ``_get_own_losses`` claims it too. That step's loss
    silently lacks (or doubles) one term, depending on where objects happened to land.
    Wraps ``stateless_call`` (the entry of the JAX trainer's train, test and predict
    steps) on ``model`` by an instance attribute.
    """
    def fresh(original):
        def stateless_call(*args, **kwargs):
            for layer in model._flatten_layers(include_self=True):
                layer._loss_ids.clear()
            return original(*args, **kwargs)
        return stateless_call

    keras_fixes.install(model, "stateless_call", fresh, key="fresh_loss_ids")

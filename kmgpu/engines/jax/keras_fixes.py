"""Keras internals the JAX engine uses or replaces, in one place.

Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
``tests/unit/test_structure.py`` checks every name still exists.
"""

import contextlib

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.jax.trainer", "_distribute_data",
     "replaced while kmgpu's call runs: keras.distribution raises IndivisibleError for a "
     "batch the device count does not divide (the last partial batch included); kmgpu "
     "places such a batch replicated instead (upstream: no issue filed)"),
    ("keras.src.layers.layer", "Layer._track_variable",
     "stateful RNN states are untracked, so the JAX trainer's jitted steps carry no "
     "state in fit/predict (3.15.1): track_states tracks them"),
    ("keras.src.backend.jax.trainer", "JAXTrainer.predict_step",
     "wrapped on replicas under jax.distributed so every process can read all "
     "prediction rows"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization.call",
     "replaced on the replica's BatchNormalization layers (instance attribute, never the "
     "user's model) when sync_batchnorm=False: each replica's own moments, no collective "
     "(batchnorm.py); reads the layer's axis, momentum, epsilon, center, scale, renorm, "
     "synchronized, gamma, beta, moving_mean, moving_variance"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.add_variable_from_reference",
     "shard_optimizer=True (zero.py): it passes each slot its weight's _layout (whole on every "
     "device under DataParallel); lay_out_optimizer replaces add_variable on the replica's "
     "optimizer (instance attribute) to pass a layout sharded over the devices instead"),
    ("keras.src.backend.jax.core", "JaxVariable._direct_assign",
     "shard_optimizer=True: an optimizer variable built before is re-laid by setting its "
     "private _layout and assigning its value again (_direct_assign places it by _layout)"),
    ("keras.src.optimizers.base_optimizer",
     "BaseOptimizer._overwrite_model_variables_with_average_value",
     "use_ema: fit's finalize_variable_values assigns each average's jax.Array itself to its "
     "variable, so both hold one buffer; the replica stays resident, and its next train step "
     "(donated arguments) gets that buffer twice: XLA refuses, and with several devices the "
     "process dies (SIGSEGV). separate_ema_overwrite wraps it on the replica's optimizer "
     "(instance attribute) to give each variable a copy"),
    ("keras.src.layers.layer", "Layer._clear_losses",
     "a layer keeps the id() of each loss it adds inside a traced step (_loss_ids) after "
     "the trace ends; in a later trace (a new batch shape: the last partial batch) another "
     "layer's new loss may get a stale id, and _clear_losses removes it from the step (or "
     "_get_own_losses counts it twice): fresh_loss_ids clears the ids before each trace "
     "(wraps stateless_call on the replica, an instance attribute)"),
]


@contextlib.contextmanager
def replicate_indivisible(distribution):
    """Within the block, Keras's JAX trainer replicates batches it cannot shard evenly.

    The trainer caches one layout per epoch from the first batch and calls the
    module-level ``_distribute_data(data, layouts)`` for every batch; this wraps it.
    """
    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec
    from keras.src.backend.jax import trainer as jax_trainer

    original = jax_trainer._distribute_data
    n = distribution.num_model_replicas
    replicated = NamedSharding(distribution.device_mesh.backend_mesh, PartitionSpec())

    def distribute(data, layouts=None):
        if jax.process_count() > 1:  # each process holds the whole batch (kmgpu launch)
            from kmgpu.engines.jax import runtime

            return runtime.put_global(data, replicated.mesh, distribution.batch_dim_name)
        flat = [d for d in keras.tree.flatten(data) if d is not None]
        if all(d.shape and d.shape[0] % n == 0 for d in flat):
            return original(data, layouts)
        return keras.tree.map_structure(
            lambda d: None if d is None else jax.device_put(d, replicated), data
        )

    jax_trainer._distribute_data = distribute
    try:
        yield
    finally:
        jax_trainer._distribute_data = original


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
    import types

    import keras

    from kmgpu.engines.jax import batchnorm

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
        original = layer.call

        def call(self, inputs, training=None, mask=None, _original=original):
            batch = inputs.shape[0]
            if (not (training and self.trainable) or batch is None or batch % n
                    or self.axis % len(inputs.shape) == 0
                    or (mask is not None and len(mask.shape) != len(inputs.shape) - 1)):
                return _original(inputs, training=training, mask=mask)
            outputs, mean, variance = batchnorm.normalize(self, inputs, mask, mesh, axis_name)
            batchnorm.update_moving(self, mean, variance)
            return outputs

        object.__setattr__(layer, "call", types.MethodType(call, layer))
        local += 1
    return local, kept


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


def replicated_predictions(replica, mesh):
    """Make ``predict`` outputs replicated, so every process can read all rows
    (a batch-sharded output spans other processes' devices)."""
    import types

    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    step = replica.predict_step

    def predict_step(self, state, data):  # Keras's JAX trainer: (outputs, state)
        outputs, non_trainable = step(state, data)
        return keras.tree.map_structure(
            lambda t: jax.lax.with_sharding_constraint(t, replicated), outputs), non_trainable

    replica.predict_step = types.MethodType(predict_step, replica)


def lay_out_optimizer(optimizer, layout_of):
    """``shard_optimizer=True`` (``zero.py``): give ``optimizer``'s variables the layout
    ``layout_of(shape)`` (None: the layout Keras gives).

    Keras's ``add_variable_from_reference`` passes each slot its weight's ``_layout``
    (whole on every device under DataParallel) to ``add_variable``; an instance
    attribute ``add_variable`` (on the replica's optimizer, never the user's) swaps in
    the sharded layout, so a slot is created sharded. Variables the optimizer has
    already are re-laid (``_layout``, then re-assigned: ``_direct_assign`` places the
    value by it).
    """
    if getattr(optimizer, "_kmgpu_laid_out", False):
        return
    original = optimizer.add_variable

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                     layout=None, name=None):
        layout = layout_of(tuple(shape)) or layout
        return original(shape, initializer=initializer, dtype=dtype,
                        aggregation=aggregation, layout=layout, name=name)

    object.__setattr__(optimizer, "add_variable", add_variable)
    object.__setattr__(optimizer, "_kmgpu_laid_out", True)
    for v in optimizer.variables:
        new = layout_of(tuple(v.shape))
        if new is not None:
            v._layout = new
            v.assign(v.value)


def separate_ema_overwrite(optimizer):
    """``use_ema``: after Keras overwrites the variables with their averages (the end of
    ``fit``), each variable holds a copy, not its average's own array.

    Keras's ``_overwrite_model_variables_with_average_value`` assigns the average's
    array; a variable and its average sharing one buffer reach the next donated train
    step as two arguments. Replaces the method on ``optimizer`` (and a loss-scale
    wrapper's inner optimizer, which does the overwrite) by an instance attribute.
    """
    import jax.numpy as jnp

    name = "_overwrite_model_variables_with_average_value"
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or not getattr(opt, "use_ema", False) or name in vars(opt):
            continue
        original = getattr(opt, name)

        def overwrite(trainable_variables, _original=original):
            _original(trainable_variables)
            for v in trainable_variables:
                v.assign(jnp.copy(v.value))

        object.__setattr__(opt, name, overwrite)


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
    if getattr(model, "_kmgpu_fresh_loss_ids", False):
        return
    original = model.stateless_call

    def stateless_call(*args, **kwargs):
        for layer in model._flatten_layers(include_self=True):
            layer._loss_ids.clear()
        return original(*args, **kwargs)

    object.__setattr__(model, "stateless_call", stateless_call)
    object.__setattr__(model, "_kmgpu_fresh_loss_ids", True)

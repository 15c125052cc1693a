"""Keras's JAX train, test and predict steps on replicas: predictions every process can
read, each trace's own loss ids, and a sharded step's XLA CPU options. Rows of
``kmgpu/engines/jax/keras_fixes.py``.
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


#: XLA CPU compiler options for a sharded step (``shard="gradients"`` / ``"weights"``),
#: given per computation (``jax.jit(compiler_options=...)``), never to the process:
#: - XLA's CPU pipeline all-reduces a gradient and slices each device's piece (its GPU
#:   pipeline makes that a reduce-scatter); its ``cpu-all-reduce-combiner`` then merges
#:   every gradient's all-reduce into one at the end of the backward pass, so each device
#:   holds the whole summed gradients at once. Without it each gradient is reduced and
#:   sliced as the backward pass makes it.
#: - Its default (concurrency-optimized) scheduler starts every weight's all-gather at
#:   the top of the step, so each device holds all the whole weights at once; the
#:   memory-optimized one gathers a weight where it is used.
#: At 14.7 M parameters on 4 simulated devices the step's own buffers went from 8 to
#: under 1 byte per parameter per device (``memory_analysis().temp_size_in_bytes``).
SHARDED_CPU_OPTIONS = {
    "xla_disable_hlo_passes": "cpu-all-reduce-combiner",
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
}


def cpu_options(flags):
    """``SHARDED_CPU_OPTIONS``, with the passes ``flags`` (an ``XLA_FLAGS`` string)
    already disables kept disabled (a computation's option replaces the flag), less any
    this jaxlib's XLA does not take (``usable``)."""
    options = dict(SHARDED_CPU_OPTIONS)
    for flag in flags.split():
        name, _, value = flag.partition("=")
        if name == "--xla_disable_hlo_passes" and value:
            options["xla_disable_hlo_passes"] = value + "," + options["xla_disable_hlo_passes"]
    return usable(options)


_USABLE = {}  # (option, value) -> whether this process's XLA compiles with it


def usable(options):
    """The entries of ``options`` this jaxlib's XLA takes, each tried once per process on
    a trivial computation: an option an older XLA does not know would fail the compile of
    every step, where leaving it out only costs memory."""
    import jax
    import numpy as np

    kept = {}
    for item in options.items():
        if item not in _USABLE:
            try:
                jax.jit(lambda x: x + 1, compiler_options=dict([item])).lower(
                    np.float32(0)).compile()
                _USABLE[item] = True
            except Exception:  # XLA's error for an unknown option or value
                _USABLE[item] = False
        if _USABLE[item]:
            kept[item[0]] = item[1]
    return kept


def compile_with(replica, options):
    """Keras's jitted train, test and predict steps of ``replica`` compiled with XLA
    ``options`` (``jax.jit``'s ``compiler_options``).

    The JAX trainer's ``make_train_function`` (and test, predict) call the ``jit`` of
    ``keras.src.backend.jax.trainer``; an instance attribute on the replica (never the
    user's model) runs each with that ``jit`` swapped for one that adds ``options``.
    Not under NNX (Keras's ``jit`` is then ``nnx.jit``).
    """
    import functools

    import keras
    from keras.src.backend.jax import trainer

    if keras.config.is_nnx_enabled():
        return

    def adding(jit):
        return functools.partial(jit, compiler_options=options)

    def with_options(original):
        def make_function(force=False):
            with keras_fixes.swapped((trainer, "jit", adding)):
                return original(force=force)
        return make_function

    for name in ("make_train_function", "make_test_function", "make_predict_function"):
        keras_fixes.install(replica, name, with_options, key="compile_with." + name)

"""The JAX engine's Keras-patch registry: every Keras internal it replaces, wraps or calls
(``PATCHES``) and the private attributes it only reads (``READS``), in the form of
``kmgpu/engines/keras_fixes.py``, whose rows every backend shares. The code is in
``step_fixes``, ``data_fixes``, ``layer_fixes`` and ``optimizer_fixes`` beside this
module.
"""

KERAS = ">=3.14,<3.16"

# Where Keras releases differ for this engine (each handled where it is read):
# - keras.distribution.DataParallel.num_model_replicas: in 3.15, not in 3.14;
#   data_fixes.model_replicas reads the mesh both have.
# - Variable._layout: see its READS row.
# - _distribute_data(data) with a None leaf (train_on_batch's sample_weight=None): 3.15
#   skips it, 3.14 reads its shape and fails; data_fixes.replicate_indivisible places
#   the other leaves one by one.

#: (module, attribute (dotted within the module), by, why)
PATCHES = [
    ("keras.src.backend.jax.trainer", "_distribute_data", "data_fixes.replicate_indivisible",
     "swapped while kmgpu's call runs: keras.distribution raises IndivisibleError for a "
     "batch the device count does not divide (the last partial batch included); kmgpu "
     "places such a batch replicated instead (upstream: no issue filed)"),
    ("keras.src.backend.jax.trainer", "JAXTrainer.predict_step",
     "step_fixes.replicated_predictions",
     "wrapped on replicas under jax.distributed so every process can read all "
     "prediction rows"),
    ("keras.src.layers.layer", "Layer.stateless_call", "step_fixes.fresh_loss_ids",
     "wrapped on the replica (the entry of the JAX trainer's train, test and predict "
     "steps) to clear each layer's _loss_ids before each trace (see _clear_losses)"),
    ("keras.src.layers.layer", "Layer._clear_losses", "step_fixes.fresh_loss_ids",
     "a layer keeps the id() of each loss it adds inside a traced step (_loss_ids) after "
     "the trace ends; in a later trace (a new batch shape: the last partial batch) another "
     "layer's new loss may get a stale id, and _clear_losses removes it from the step (or "
     "_get_own_losses counts it twice)"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization.call",
     "layer_fixes.local_batchnorm",
     "replaced on the replica's BatchNormalization layers (never the user's model) when "
     "sync_batchnorm=False: each replica's own moments, no collective (batchnorm.py); "
     "reads the layer's axis, momentum, epsilon, center, scale, renorm, synchronized, "
     "gamma, beta, moving_mean, moving_variance"),
    ("keras.src.layers.layer", "Layer._track_variable", "layer_fixes.track_states",
     "stateful RNN states are untracked, so the JAX trainer's jitted steps carry no "
     "state in fit/predict (3.15.1): track_states tracks them, unlocking the layer's "
     "_tracker for it, and lays each out by rows (_layout)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.add_variable_from_reference",
     "optimizer_fixes.lay_out_optimizer",
     "shard_optimizer=True (zero.py): it passes each slot its weight's _layout (whole on "
     "every device under DataParallel); add_variable, replaced on the replica's optimizer, "
     "passes a layout sharded over the devices instead"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.add_variable",
     "optimizer_fixes.lay_out_optimizer",
     "same: what is replaced; optimizer_fixes.build_holding replaces it too, on the user's "
     "optimizer while host.built_on_host builds it, so each slot starts as the replica's "
     "array (its initializer, called with (shape, dtype=), returns it) instead of whole "
     "zeros on the host"),
    ("keras.src.backend.jax.core", "JaxVariable._direct_assign",
     "optimizer_fixes.lay_out_optimizer",
     "an optimizer variable built before is re-laid by setting its private _layout and "
     "assigning its value again (_direct_assign places it by _layout). Every assign goes "
     "through it: optimizer_fixes.hold's subclass overrides it to let its array go"),
    ("keras.src.backend.common.variables", "Variable.value", "optimizer_fixes.hold",
     "shard= (host.py): after a fit the user's optimizer variable holds the replica's "
     "sharded array, its class swapped for a subclass whose value property gathers it to "
     "the host first; Keras reads a variable's value through this property (ops, numpy(), "
     "np.asarray, saving, the JAX trainer's state for a plain fit)"),
    ("keras.src.backend.jax.core", "JaxVariable._initialize_layout",
     "kmgpu.engines.jax.zero.Distribution",
     "shard='weights': a variable made in a distribution's scope without a layout takes "
     "distribution.get_variable_layout(variable) (whole on every device under "
     "DataParallel), its shape and dtype already set; zero.Distribution, a DataParallel "
     "subclass, answers a sharded layout there, so the value is placed 1/N per device"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.stateless_apply",
     "optimizer_fixes.constrain_gradients",
     "shard='gradients' / 'weights' (zero.py): Keras's JAX train_step hands the gradients "
     "of jax.value_and_grad to optimizer.stateless_apply, replicated under DataParallel (an "
     "all-reduce); wrapped on the replica's optimizer to constrain each gradient to its "
     "slot's sharded layout first (jax.lax.with_sharding_constraint), so XLA reduce-scatters"),
    ("keras.src.backend.jax.trainer", "jit", "step_fixes.compile_with",
     "swapped while the replica's make_train_function (and test, predict) runs, for "
     "jax.jit with XLA compiler_options added: a sharded step on CPU devices compiled "
     "so that it holds one layer's whole weights and gradients at a time "
     "(step_fixes.SHARDED_CPU_OPTIONS)"),
    ("keras.src.backend.jax.trainer", "JAXTrainer.make_train_function",
     "step_fixes.compile_with", "wrapped on the replica (and make_test_function, "
     "make_predict_function) to run with that jit"),
    ("keras.src.optimizers.base_optimizer",
     "BaseOptimizer._overwrite_model_variables_with_average_value",
     "optimizer_fixes.separate_ema_overwrite",
     "use_ema: fit's finalize_variable_values assigns each average's jax.Array itself to "
     "its variable, so both hold one buffer; the replica stays resident, and its next train "
     "step (donated arguments) gets that buffer twice: XLA refuses, and with several "
     "devices the process dies (SIGSEGV). Wrapped on the replica's optimizer to give each "
     "variable a copy"),
]

#: (module, attribute, what for): private Keras attributes read, or set as Keras does
READS = [
    ("keras.src.layers.layer", "Layer._tracker", "layer_fixes.track_states (see PATCHES)"),
    ("keras.src.layers.layer", "Layer._loss_ids", "step_fixes.fresh_loss_ids (see PATCHES)"),
    # Keras 3.15 sets _remat_mode in Operation.__init__, 3.14 in Layer.__init__.
    ("keras.src.layers.layer", "Layer._remat_mode",
     "layer_fixes.keep_remat: a layer's keras.RematScope mode, set from the template's "
     "on the replica's layer in its place (read by Layer.stateless_call at every call)"),
    # Keras 3.15 sets _layout in the common Variable (a TensorLayout); 3.14 only in
    # JaxVariable, where it holds the backend's NamedSharding once the variable exists.
    # kmgpu sets a TensorLayout, which _direct_assign (distribute_tensor) takes in both.
    ("keras.src.backend.jax.core", "JaxVariable._layout",
     "layer_fixes.track_states, optimizer_fixes.lay_out_optimizer: a variable's layout"),
    ("keras.src.backend.common.variables", "Variable._value",
     "kmgpu.engines.jax.engine: whether a resident replica's variable was emptied"),
]

"""The TensorFlow engine's Keras-patch registry: every Keras (and TensorFlow) internal it
replaces, wraps or calls (``PATCHES``) and the private attributes it only reads
(``READS``), in the form of ``kmgpu/engines/keras_fixes.py``, whose rows every backend
shares. The code is in ``step_fixes``, ``data_fixes``, ``layer_fixes`` and
``optimizer_fixes`` beside this module.
"""

KERAS = ">=3.14,<3.16"

#: (module, attribute (dotted within the module), by, why)
PATCHES = [
    # -- the train and test steps (step_fixes) -------------------------------------------
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica", "step_fixes.reduce_fix",
     "swapped during kmgpu's calls: it reduces multi-worker scalar metrics with axis=0, "
     "which fails (\"Invalid reduction dimension 0\", keras-team/keras#20585)"),
    ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker",
     "step_fixes.reduce_fix", "read by the replacement above"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._symbolic_build",
     "step_fixes.symbolic_build",
     "called on the first batch of the undistributed data (kmgpu.engines.tensorflow.engine "
     "puts symbolic_build in the replica's _maybe_symbolic_build): Keras averages the "
     "first batch over replicas, which fails when it splits unevenly, and drops the new "
     "distributed iterator it read it from at once, which now and then crashed the "
     "process (SIGSEGV in EpochIterator.reset)"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._maybe_symbolic_build",
     "kmgpu.engines.tensorflow.engine.TensorFlowEngine.prepare_replica",
     "replaced on each replica by symbolic_build (above); run_on_batch calls it"),
    ("keras.src.trainers.data_adapters.tf_dataset_adapter", "TFDatasetAdapter",
     "step_fixes.symbolic_build", "same: its get_tf_dataset() is the undistributed data"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer",
     "step_fixes.keeps_keras_step",
     "its train_step and test_step are replaced on replicas (train_step, test_step) only "
     "where the user's model keeps Keras's own"),
    ("keras.src.trainers.trainer", "Trainer.compute_loss", "step_fixes.exact_custom_steps",
     "replaced on replicas of models with their own train_step: its result is scaled by "
     "1/N for tf.distribute, so a loss tracker fed with it shows the loss divided by N, "
     "and a partial last batch weighs every replica alike"),
    ("keras.src.trainers.compile_utils", "CompileLoss.call", "step_fixes.weigh_output_losses",
     "replaced on replicas: it records each output's loss with weight y_pred.shape[0], "
     "None in a traced step, so every replica counts alike"),
    ("keras.src.metrics.reduction_metrics", "Mean.update_state",
     "step_fixes.weigh_output_losses", "replaced on the per-output loss trackers, same"),
    ("keras.src.utils.python_utils", "pythonify_logs", "step_fixes.metrics_logs",
     "train_on_batch / test_on_batch under MirroredStrategy return the mean of each "
     "replica's own metric results, wrong when a batch splits unevenly; kmgpu reads the "
     "summed metric variables instead, formatted as Keras does"),
    ("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order",
     "step_fixes.metrics_logs", "same"),
    ("keras.src.trainers.trainer", "Trainer._get_metrics_result_or_logs",
     "step_fixes.synced_logs",
     "replaced on replicas: it returns the metrics read across replicas only when the "
     "step's logs have their keys; a custom step that returns {m.name: m.result()} "
     "(keras.io's guide) nests CompileMetrics' results, so Keras returns the mean of each "
     "replica's own results, wrong when batches split unevenly"),
    ("keras.src.trainers.trainer", "Trainer.reset_metrics", "step_fixes.traced_reset_metrics",
     "replaced on replicas whose metrics are all Keras's own: under tf.distribute each "
     "metric variable's reset is eager, an assign to every replica's copy and a read "
     "summed over them; train_on_batch resets at every call"),
    ("keras.src.trainers.trainer", "Trainer.get_metrics_result", "step_fixes.global_logs",
     "replaced on replicas: inside a step each replica reads its own metric variables, "
     "and Keras's TF trainer hands on_train_batch_end the mean of the replicas' results, "
     "which differs from one device's when a batch splits unevenly (the loss tracker's "
     "counts then differ between replicas)"),
    # -- data (data_fixes) ----------------------------------------------------------------
    ("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter",
     "data_fixes.repeating_datasets",
     "fit on arrays fed as one repeating tf.data pipeline: Keras makes a new distributed "
     "iterator every epoch for arrays (~0.4 s per epoch under MirroredStrategy)"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays",
     "data_fixes.repeating_datasets", "same"),
    ("tensorflow.python.eager.context", "global_seed", "data_fixes.first_pass_order",
     "under a global seed Keras's array pipeline reads the same shuffled permutation "
     "every epoch (a new iterator restarts its stateful shuffle), which the repeating "
     "pipeline would not"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split",
     "data_fixes.repeating_datasets", "same"),
    ("keras.src.trainers.data_adapters.data_adapter_utils", "unpack_x_y_sample_weight",
     "data_fixes.repeating_datasets", "same, and the weighted train_step"),
    ("keras.src.backend.tensorflow.trainer", "TFEpochIterator._get_iterator",
     "data_fixes.park_iterators",
     "wrapped during kmgpu's calls: Keras drops a distributed iterator while its "
     "per-device prefetch may still be fetching (a repeating dataset at the end of fit, a "
     "validation iterator at each reset); tf.data's MultiDeviceIterator then crashes the "
     "process now and then (SIGSEGV, 1 in ~150 one-epoch fits on 4 CPU devices under "
     "load); kmgpu keeps each one until the next call, when it is idle, and drops it then "
     "on a thread of its own: the drop waited, idle, 0.2-20 s now and then (TensorFlow's "
     "teardown of the MultiDeviceIterator; 51 of 150 drops over 0.2 s on a loaded 2-core "
     "machine; see untuned_iterators), which the user's next call does not wait for"),
    ("tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset",
     "data_fixes.untuned_iterators",
     "wrapped during calls: destroying a MultiDeviceIterator waits out the sleep (up to "
     "60 s) of each autotuned pipeline's tuning thread: drops of a distributed iterator "
     "waited 0.2-20 s, processes hung 5-360 s at exit; this makes each replica's "
     "per-device pipeline (nothing to tune) untuned"),
    ("tensorflow.python.data.ops.multi_device_iterator_ops",
     "OwnedMultiDeviceIterator.__init__", "data_fixes.untuned_iterators",
     "same, for the host pipeline it reads"),
    # -- layers (layer_fixes) -------------------------------------------------------------
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments",
     "layer_fixes.synced_moments",
     "replaced on replica BatchNorm layers with sync_batchnorm: Keras's synchronized "
     "moments take 3 all-reduces per layer and var = E[x^2] - E[x]^2, which loses float32 "
     "digits that one device's two-pass tf.nn.moments keeps"),
    ("tensorflow.python.ops.custom_gradient", "_graph_mode_decorator",
     "layer_fixes.all_reduce_without_walk",
     "wrapped during calls: tracing a replica's all_reduce walks the graph back from its "
     "merged output, which reaches every replica's whole graph, to find variables it "
     "cannot use; per all-reduce, so synchronized BatchNorm traced in time quadratic in "
     "depth (MobileNetV2: over 400 s)"),
    ("tensorflow.python.ops.custom_gradient", "_get_dependent_variables",
     "layer_fixes.all_reduce_without_walk", "same"),
    ("tensorflow.python.distribute.distribute_lib", "ReplicaContextBase.all_reduce",
     "layer_fixes.all_reduce_without_walk",
     "its grad_wrapper is what all_reduce_without_walk recognises"),
    ("keras.src.layers.layer", "Layer._losses", "layer_fixes.per_thread_losses",
     "replaced on each replica's layers by a list per thread: a layer keeps the losses its "
     "call added in one list, shared by tf.distribute's replica threads; they take turns "
     "at every all-reduce, and a layer run on the global batch (global_losses) "
     "all-gathers within the forward pass, so one replica's losses would be read, or "
     "cleared, by another"),
    ("keras.src.layers.layer", "Layer.add_loss", "layer_fixes.per_thread_losses",
     "same: what appends to it"),
    ("keras.src.layers.layer", "Layer._get_own_losses", "layer_fixes.per_thread_losses",
     "same: what reads _losses"),
    ("keras.src.layers.layer", "Layer._clear_losses", "layer_fixes.per_thread_losses",
     "same: what clears it"),
    # -- optimizers (optimizer_fixes) -----------------------------------------------------
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply",
     "optimizer_fixes.accumulate_across_replicas",
     "replaced on replica optimizers with gradient_accumulation_steps, or use_ema with "
     "ema_overwrite_frequency: under tf.distribute it fails with merge_call inside its "
     "Cond (keras-team/keras#17429)"),
    ("tensorflow", "__internal__.distribute.interim.maybe_merge_call",
     "optimizer_fixes.accumulate_across_replicas",
     "swapped for a direct call in cross-replica context while that apply runs there (it "
     "would ask a missing replica context to merge)"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._clip_gradients",
     "optimizer_fixes.reduce_before_clipping",
     "replaced on replica optimizers that clip: Keras clips each replica's gradient "
     "before the all-reduce, so global_clipnorm, clipnorm and clipvalue see 1/N of the "
     "batch (4 replicas: 0.18 relative from one device)"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer._all_reduce_sum_gradients",
     "optimizer_fixes.reduce_before_clipping",
     "same: skipped for gradients already summed before clipping"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer._tf_apply",
     "optimizer_fixes.finite_over_replicas",
     "replaced on replica loss-scale optimizers: it takes \"the gradients are finite\" "
     "from the first replica's gradients, before they are summed, so another replica's "
     "overflow is applied as inf (NaN weights from then on)"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer.check_finite",
     "optimizer_fixes.finite_over_replicas", "same: each replica's flag is all-reduced"),
    ("keras.src.optimizers.loss_scale_optimizer",
     "LossScaleOptimizer._stateful_handle_finite_grads",
     "optimizer_fixes.finite_over_replicas", "called as Keras's _tf_apply does"),
    ("keras.src.optimizers.loss_scale_optimizer",
     "LossScaleOptimizer._stateful_handle_non_finite_grads",
     "optimizer_fixes.finite_over_replicas", "same"),
]

#: (module, attribute, what for): private Keras attributes read, or set as Keras does
READS = [
    ("keras.src.trainers.trainer", "Trainer._compile_metrics",
     "step_fixes.symbolic_build: whether the compiled metrics are built"),
]

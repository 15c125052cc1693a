"""The torch engine's Keras-patch registry: every Keras internal it replaces, wraps or
calls (``PATCHES``) and the private attributes it only reads (``READS``), in the form of
``kmgpu/engines/keras_fixes.py``, whose rows every backend shares. The code is in
``step_fixes``, ``data_fixes``, ``layer_fixes``, ``capture_fixes`` (what CUDA-graph
capture refuses), ``cond_fixes`` and ``fast_fixes`` (faster kernels on CUDA) beside this
module.
"""

KERAS = ">=3.14,<3.16"

#: (module, attribute (dotted within the module), by, why)
PATCHES = [
    # -- the rank's steps (step_fixes) ----------------------------------------------------
    ("keras.src.backend.torch.trainer", "TorchTrainer.train_step",
     "step_fixes.has_own_train_step",
     "compared with the model's own: a model that keeps Keras's step gets kmgpu's DDP "
     "step; one with its own train_step has its gradients averaged in optimizer.apply"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.test_step",
     "step_fixes.has_own_test_step",
     "compared likewise: Keras's test step is replaced by one that counts only this "
     "rank's real rows in the loss tracker"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.predict_step",
     "step_fixes.has_own_predict_step",
     "compared likewise: a model that keeps Keras's predict (and test) step gets it "
     "captured as a CUDA graph on one device (capture/eval_steps.py)"),
    ("keras.src.backend.torch.trainer", "TorchTrainer._get_metrics_result_or_logs",
     "step_fixes.read_logs_within",
     "replaced on each replica: Keras turns metric variables into logs here at epoch "
     "and evaluation ends; kmgpu sums the variables over ranks first (no public hook "
     "sits between the last step and the logs)"),
    ("keras.src.trainers.trainer", "Trainer.get_metrics_result",
     "step_fixes.read_logs_within",
     "installed on each replica where the torch trainer overrides it (Keras master, "
     "3.16: it all-reduces the metric variables whenever torch.distributed is "
     "initialised, at every step and over kmgpu's sums, counting a count metric once "
     "per rank; 3.14 and 3.15 do not override it): the base Trainer's, one read of the "
     "variables kmgpu has summed"),
    ("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order",
     "kmgpu.engines.torch.strategy", "train_on_batch's list of logs, in Keras's order"),
    ("keras.src.backend.torch.trainer", "TorchTrainer.evaluate", "step_fixes.keras_evaluate",
     "wrapped on each replica so fit's validation and evaluate know their rank slices"),
    ("keras.src.trainers.trainer", "Trainer._compute_loss", "step_fixes.compute_loss",
     "kmgpu's steps compute the loss as Keras's own torch steps do"),
    ("keras.src.backend.common.masking", "get_keras_mask", "step_fixes.detached",
     "a layer's output mask is an attribute of the output tensor, where a masked loss "
     "and metric read it; the split step's detached outputs carry it over"),
    ("keras.src.backend.common.masking", "set_keras_mask", "step_fixes.detached",
     "sets that attribute on the detached output"),
    ("keras.src.utils.python_utils", "pythonify_logs", "step_fixes.pythonify_logs",
     "logs as plain Python numbers, to relay them to the driver's callbacks"),
    ("keras.src.utils", "is_default", "step_fixes.is_default",
     "which hooks a user's callback implements (the test Keras's CallbackList uses)"),
    # -- data (data_fixes) ----------------------------------------------------------------
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split",
     "data_fixes.train_validation_split",
     "validation_split cut exactly as Keras's fit cuts it"),
    ("keras.src.backend.torch.trainer", "TorchEpochIterator", "data_fixes.epoch_iterator",
     "a tf.data.Dataset, generator or DataLoader read on the driver epoch by epoch "
     "exactly as Keras's torch fit takes it (steps_per_epoch continues one iterator; "
     "a DataLoader's iterator is made at each epoch end too, which draws from its "
     "generator)"),
    ("keras.src.trainers.trainer", "Trainer._symbolic_build", "step_fixes.build_within",
     "wrapped on each replica (shard='weights') to run within the layers' gathering: "
     "Keras's torch fit, evaluate and *_on_batch start with it, and until the compiled "
     "metrics and loss are built it calls the model on placeholder inputs "
     "(compute_output_spec), reading every weight; under mixed_float16 Variable.value "
     "casts it, an operation on the data of a freed layer buffer ('data is not allocated "
     "yet'). Also run by data_fixes.epoch_iterator on the user's model with that "
     "iterator, as Keras's fit and evaluate do first: it builds the compile metrics and, "
     "the first time, starts (and drops) one pass"),
    ("keras.src.trainers.epoch_iterator", "EpochIterator._enumerate_iterator",
     "data_fixes.validation_draws",
     "enumerated alone (batches are fetched in __next__) over the arrays validating a "
     "dataset fit: it makes the DataLoader iterators of one of fit's validations where "
     "Keras makes them, each drawing a seed from torch's global generator, and reads "
     "no batch"),
    # -- layers (layer_fixes) -------------------------------------------------------------
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments",
     "layer_fixes.global_batch_moments",
     "replaced on each replica with sync_batchnorm=True: moments over the global batch "
     "(Keras's torch backend has no synchronised BatchNormalization)"),
    ("keras.src.layers.rnn.rnn", "RNN.call", "layer_fixes.copy_states_in",
     "wrapped on stateful RNN layers of a replica: the torch LSTM/GRU kernels keep the "
     "state variable's tensor for backward and RNN.call then assigns it in place, so a "
     "stateful fit fails with 'modified by an inplace operation' (3.15.1; upstream: no "
     "issue known to kmgpu)"),
    ("keras.src.backend.common.variables", "Variable._initialize_with_initializer",
     "layer_fixes.unfilled_variables",
     "swapped while a pool rank builds a shard='weights' replica (optim.unfilled): a "
     "trainable weight or optimizer slot gets a tensor whose memory is freed, its "
     "initializer not run; Keras makes every variable that has an initializer (add_weight, "
     "the optimizer's slots) here, computing the value and handing it to _initialize"),
    ("keras.src.backend.torch.core", "Variable.value", "kmgpu.engines.torch.optim.held",
     "shard='weights' in a worker pool: after a fit your optimizer's slot variables stay in "
     "the ranks, their class swapped for a subclass whose value property fetches them "
     "first; Keras reads a variable through this property (ops, numpy(), np.asarray, "
     "saving, its own torch trainer)"),
    ("keras.src.backend.torch.core", "Variable._direct_assign", "kmgpu.engines.torch.optim.held",
     "the same subclass: every assign goes through it, and lets a held variable go unread"),
    # -- the captured step (capture_fixes) ------------------------------------------------
    ("keras.src.trainers.trainer", "Trainer.jit_compile", "capture_fixes.wants_captured_step",
     "read on a compiled model (graphs.choose_step): True asks kmgpu's torch engines for the "
     "split step on a CPU too (Keras's meaning, torch.compile of the step, runs measurably "
     "slower than eager on a GPU); set False (set_jit_compile) on the model that runs "
     "kmgpu's step, so Keras never wraps it in torch.compile"),
    ("keras.src.backend.torch.core", "convert_to_tensor", "capture_fixes.device_scalars",
     "its code is swapped while a captured train step runs (capture/graphs.py, "
     "compile(jit_compile=True)): Keras 3.15.1 makes a python scalar or a constant list "
     "a device tensor with torch.as_tensor(x, device=cuda), a blocking copy from "
     "pageable memory that CUDA-graph capture refuses (\"Cannot copy between CPU and "
     "CUDA tensors during CUDA graph capture\": the loss's reduce_values, BatchNorm's "
     "momentum, the optimizer's iterations.assign_add(1) and beta casts); the swap fills "
     "scalars on the device (torch.full) and caches constant lists (also the TrackedList "
     "a metric's list attribute becomes: BinaryIoU's target_class_ids in result()) and "
     "numpy constants (AUC's thresholds): the same values (upstream: no issue known to "
     "kmgpu)"),
    ("keras.src.backend.torch.random", "normal", "capture_fixes.device_random",
     "swapped (with uniform, randint, dropout, shuffle, categorical) while kmgpu's torch "
     "train step runs: Keras 3.15.1 seeds a new torch.Generator with int(seed) for every "
     "SeedGenerator draw, a device-to-host copy CUDA-graph capture refuses, so "
     "Dropout(seed=/noise_shape=), GaussianNoise, the augmentation layers and "
     "keras.random.* broke the capture; the swap draws from the seed state on the device "
     "(capture/rng.py; upstream: no issue known to kmgpu)"),
    ("keras.src.backend.torch.random", "uniform", "capture_fixes.device_random", "same"),
    ("keras.src.backend.torch.random", "randint", "capture_fixes.device_random", "same"),
    ("keras.src.backend.torch.random", "dropout", "capture_fixes.device_random", "same"),
    ("keras.src.backend.torch.random", "shuffle", "capture_fixes.device_random", "same"),
    ("keras.src.backend.torch.random", "categorical", "capture_fixes.device_random", "same"),
    ("keras.src.backend.torch.random", "_get_concrete_noise_shape",
     "capture_fixes.device_random", "Dropout's noise shape, as Keras's torch dropout "
     "computes it"),
    ("keras.src.random.seed_generator", "global_seed_generator", "capture_fixes.device_random",
     "seed=None draws from Keras's global SeedGenerator, as draw_seed does"),
    ("keras.src.random.seed_generator", "SeedGenerator._initial_seed",
     "capture_fixes.device_random",
     "an unseeded Dropout keeps torch's own dropout (capturable as it is)"),
    ("keras.src.layers.preprocessing.image_preprocessing.random_crop",
     "RandomCrop.transform_images", "capture_fixes.device_random",
     "swapped with the random functions: its training crop slices at offset tensors "
     "(a host read each, which capture refuses); kmgpu's crops with index_select on the "
     "device, then Keras's own code runs on the cropped images"),
    ("keras.src.backend.torch.math", "_segment_reduction_fn", "capture_fixes.device_random",
     "swapped with the random functions while kmgpu's step runs: segment_sum (AUC, "
     "Precision/Recall at thresholds) repeats ids by a device count, a host read on CUDA; "
     "kmgpu's broadcasts them: the same sums"),
    ("keras.src.backend.torch.core", "scatter", "capture_fixes.device_random",
     "swapped likewise: Keras adds row by row in Python (confusion_matrix: MeanIoU and the "
     "IoU metrics); kmgpu's is one index_put_ with accumulate: the same sums"),
    ("keras.src.backend.torch.numpy", "max", "capture_fixes.device_random",
     "swapped likewise: with initial= Keras 3.15.1 fills torch.full(shape, initial) from "
     "the initial value it has just made a tensor, a host read (PrecisionAtRecall, "
     "RecallAtPrecision, SensitivityAtSpecificity, SpecificityAtSensitivity in result()); "
     "kmgpu's takes torch.maximum with that tensor, as Keras's min does: the same values"),
    ("keras.src.backend.torch.core", "cond", "cond_fixes.step_conditions",
     "swapped while kmgpu's step runs (device_conditions around the optimizer): Keras "
     "3.15.1's torch cond is a Python if on a tensor, a host read CUDA-graph capture "
     "refuses; LossScaleOptimizer (mixed_float16: its finite-gradient check and loss-scale "
     "update), gradient_accumulation_steps and EMA overwrites branch with it, and so do "
     "the Hinge/SquaredHinge/CategoricalHinge losses and metrics (their 0/1-label check), "
     "so those steps could not be captured; the swap runs both branches from the same "
     "state and keeps the taken one with torch.where: the same values, no host read "
     "(upstream: no issue known to kmgpu)"),
    # -- faster kernels on CUDA (fast_fixes) ----------------------------------------------
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization.call",
     "fast_fixes.fused_batchnorm",
     "swapped while kmgpu's step runs on a CUDA device (KMGPU_TORCH_FUSED_BN=0 keeps "
     "Keras's layer; as close to a float64 layer as Keras's or closer, "
     "benchmarks/lab/torch_bn_parity.py): Keras 3.15.1's torch BatchNormalization is dozens of "
     "kernels per layer per training step (moments, normalisation, moving averages and "
     "their backward: a large share of a BatchNorm-heavy network's GPU time); "
     "fast_layers.batch_norm_call computes the same layer with torch's fused batch norm "
     "(Keras's own call for what it does not cover: masks, renorm, synchronized, kmgpu's "
     "global-batch moments)"),
    ("keras.src.backend.torch.nn", "sparse_categorical_crossentropy", "fast_fixes.fast_ops",
     "swapped while kmgpu's step runs on a CUDA device (KMGPU_TORCH_FAST_LOSS=0 keeps "
     "Keras's): Keras 3.15.1 moves the class axis to position 1 (movedim) before "
     "F.cross_entropy, so (batch, seq, classes) logits reach torch as a strided tensor it "
     "copies contiguous and runs its spatial log-softmax / nll_loss2d kernels over, forward "
     "and backward (a large share of a transformer's step on a GPU); fast_layers takes "
     "F.cross_entropy over the contiguous (rows, classes) view: the same losses, measurably "
     "faster (Keras's code for what it does not cover: probabilities, a class axis not "
     "last, rank 2)"),
    ("keras.src.layers.core.dense", "Dense.call", "fast_fixes.fast_ops",
     "swapped likewise (KMGPU_TORCH_FAST_DENSE=0 keeps Keras's): Keras 3.15.1 runs matmul "
     "then a separate add of the bias over the whole output; fast_layers.dense_call runs "
     "F.linear (addmm, the bias in cuBLAS's epilogue), then the activation: the same values "
     "up to float32 rounding, one kernel fewer per layer (Keras's call for quantized "
     "layers, no bias, other dtypes)"),
    ("keras.src.layers.core.einsum_dense", "EinsumDense.call", "fast_fixes.fast_ops",
     "swapped likewise (KMGPU_TORCH_FAST_EINSUM=0 keeps Keras's): Keras 3.15.1 runs einsum "
     "then a separate add of the bias, a broadcast torch runs in its generic elementwise "
     "kernel (MultiHeadAttention's four projections in every block); where the equation is "
     "a Dense over flattened axes and the bias covers the kernel's output axes, "
     "fast_einsum.call runs F.linear over 2-D views: the same values up to float32 "
     "rounding (Keras's call for other equations, quantized layers, no bias, other "
     "dtypes)"),
    ("keras.src.backend.torch.nn", "_transpose_spatial_inputs", "fast_fixes.fast_ops",
     "swapped likewise (KMGPU_TORCH_FAST_CONV=0 keeps Keras's): Keras 3.15.1 moves a "
     "channels_last input's channel axis with permute + .contiguous() (a copy into NCHW) "
     "before every convolution and pooling, and conv then copies that back into torch's "
     "channels_last format for cuDNN; fast_conv.spatial_inputs returns the permuted view, "
     "which already is channels_last: the same values and memory format at the convolution, "
     "two activation copies fewer per convolution (Keras's function for 1-D and meta inputs)"),
    ("keras.src.layers.rnn.gru", "GRU.inner_loop", "fast_fixes.fast_ops",
     "swapped likewise (KMGPU_TORCH_FAST_RNN=0 keeps Keras's): Keras 3.15.1's torch gru() "
     "raises NotImplementedError for any mask, so a masked GRU runs the generic rnn() "
     "loop, one Python iteration and a dozen kernels per timestep (thousands of kernels per "
     "step for a bidirectional GRU over 128 steps); fast_rnn moves each row's valid "
     "steps to the front on the device (cumsum, gather: no host read, capturable) and "
     "runs the unmasked cuDNN GRU Keras runs without a mask, then maps back: the generic "
     "loop's outputs, states and last_output for any mask, in a few hundred kernels "
     "(Keras's code for what it does not cover: fast_rnn.why_not)"),
    ("keras.src.layers.rnn.lstm", "LSTM.inner_loop", "fast_fixes.fast_ops",
     "swapped likewise: Keras 3.15.1's torch lstm() raises NotImplementedError for any "
     "mask (the generic per-timestep loop); fast_rnn runs the compacted sequence through "
     "the cuDNN LSTM where the layer discards its final states (the cell state at a row's "
     "last valid step is not among cuDNN's outputs: return_state and stateful keep "
     "Keras's loop)"),
]

#: (module, attribute, what for): private Keras attributes read, or set as Keras does
READS = [
    ("keras.src.backend.common.variables", "Variable._value",
     "optim.held: a held slot's tensor, for bookkeeping that must not fetch it (which "
     "tensor it is, its version, its device)"),
    ("keras.src.trainers.trainer", "Trainer._initial_epoch",
     "relay: the epoch Keras's fit resumes from (BackupAndRestore sets it), read from the "
     "template and set on it as Keras's fit does"),
    ("keras.src.callbacks.callback_list", "CallbackList._history",
     "relay: the History Keras's CallbackList adds for fit"),
    ("keras.src.layers.layer", "Layer._seed_generators",
     "strategy: each layer's SeedGenerators, seeded per rank"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._trainable_variables",
     "flat_optim: the variables the optimizer was built for"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._trainable_variables_indices",
     "flat_optim: its index of them"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer._get_variable_index",
     "flat_optim: a variable's slot position"),
    ("keras.src.backend.torch.core", "Variable._initialize",
     "layer_fixes.unfilled_variables: a tensor becomes the variable's Parameter (its "
     "memory shared, not copied)"),
    ("keras.src.optimizers.nadam", "Nadam._u_product",
     "flat_optim, flat_updates: Nadam's running momentum product"),
]

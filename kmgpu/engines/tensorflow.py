"""TensorFlow engine: ``tf.distribute.MirroredStrategy`` over the chosen devices.

The replica is created and compiled inside ``strategy.scope()`` (both are required
by tf.distribute). Keras splits each global batch over the replicas and scales each
replica's loss by 1/N, which is exact only when the split is even; kmgpu's train
step weights each replica's loss by its share of the global batch, so a partial
last batch gives the one-device update. ``sync_batchnorm`` uses Keras's own
``BatchNormalization(synchronized=True)``.
"""

import types

from kmgpu.engines.base import InProcessEngine


class TensorFlowEngine(InProcessEngine):
    name = "tf.distribute.MirroredStrategy"

    def __init__(self, device_ids, available, options):
        super().__init__(device_ids, available, options)
        import tensorflow as tf

        kind = available[device_ids[0]][0].upper()
        logical = tf.config.list_logical_devices(kind)
        names = [logical[i].name for i in device_ids]
        from kmgpu.engines import _multiworker

        multi = _multiworker.tf_strategy()  # several processes (kmgpu launch)
        if multi is not None:  # every device of every worker
            self.strategy, self.name = multi, "tf.distribute.MultiWorkerMirroredStrategy"
            n = multi.num_replicas_in_sync
            self.device_ids, self.device_names = list(range(n)), [f"replica:{i}" for i in range(n)]
        elif len(names) == 1:
            self.strategy = tf.distribute.OneDeviceStrategy(names[0])
            self.name = "tf.distribute.OneDeviceStrategy"
        else:
            # NCCL serves GPUs; logical CPU devices need a plain reduction.
            ops = tf.distribute.ReductionToOneDevice() if kind == "CPU" else None
            self.strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)

    def scope(self):
        return self.strategy.scope()

    def call_context(self, method):
        from kmgpu.engines import _multiworker

        return _multiworker.tf_reduce_fix(self.strategy)

    def replica_batch(self, global_batch):
        return global_batch // self.num_replicas  # each replica runs the model on its rows

    def read_states(self, replica):
        import numpy as np

        from kmgpu import stateful

        return [np.concatenate([np.asarray(c) for c in
                                self.strategy.experimental_local_results(v.value)])
                for v in stateful.state_variables(replica)]

    def write_states(self, replica, arrays):
        import numpy as np

        from kmgpu import stateful

        for v, a in zip(stateful.state_variables(replica), arrays):
            components = self.strategy.experimental_local_results(v.value)
            for component, rows in zip(components, np.split(a, len(components))):
                component.assign(rows)

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        if method == "fit":
            kwargs = _repeating_datasets(kwargs)
        return super().run(method, template, kwargs, lr_scale)

    def prepare_replica(self, replica, template):
        import keras
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        if self.num_replicas == 1:
            return
        if self.options.sync_batchnorm:
            for layer in replica._flatten_layers():
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.synchronized = True
        if type(template).train_step is TensorFlowTrainer.train_step:
            replica.train_step = types.MethodType(_train_step, replica)
        replica._maybe_symbolic_build = types.MethodType(_symbolic_build, replica)


def _repeating_datasets(kwargs):
    """fit() on arrays, fed as repeating ``tf.data`` pipelines with known steps.

    For arrays Keras makes a new distributed iterator every epoch, which costs
    MirroredStrategy ~0.4 s per epoch on 4 devices. Given ``steps_per_epoch`` and
    a repeating dataset, Keras keeps one iterator for the whole fit. The dataset
    is Keras's own (``ArrayDataAdapter``): the same batches, the same per-epoch
    shuffling, class weights and partial last batch; each epoch reads exactly
    one pass. Validation arrays get the same treatment with ``validation_steps``.
    """
    from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
    from keras.src.trainers.data_adapters import data_adapter_utils

    def arrays(*data):
        return array_data_adapter.can_convert_arrays(data) and data[0] is not None

    kw = dict(kwargs)
    x, y, weights = kw.get("x"), kw.get("y"), kw.get("sample_weight")
    if (kw.get("steps_per_epoch") is not None or not arrays(x, y, weights)
            or kw.get("epochs", 1) - kw.get("initial_epoch", 0) < 2):
        return kwargs  # one epoch makes one iterator either way
    if kw.get("validation_split") and kw.get("validation_data") is None:
        (x, y, weights), kw["validation_data"] = array_slicing.train_validation_split(
            (x, y, weights), validation_split=kw["validation_split"])
    kw["validation_split"] = 0.0
    batch_size = kw.get("batch_size") or 32
    train = array_data_adapter.ArrayDataAdapter(
        x, y, sample_weight=weights, batch_size=batch_size,
        shuffle=kw.get("shuffle", True), class_weight=kw.get("class_weight"))
    kw.update(x=train.get_tf_dataset().repeat(), y=None, sample_weight=None, shuffle=False,
              class_weight=None, batch_size=None, steps_per_epoch=train.num_batches)
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


def _symbolic_build(self, iterator=None, data_batch=None):
    """Keras builds metrics and optimizer from the first batch, averaged over replicas,
    which fails when the first batch splits unevenly. Only its shapes matter, so
    build from the first replica's part instead.
    """
    built = (all(layer.built for layer in self._flatten_layers())
             and all(part is None or part.built for part in
                     (self._compile_metrics, self._compile_loss, self.optimizer)))
    if built:
        return  # nothing to build: skip making a distributed iterator (~0.15 s on 4 devices)
    if iterator is not None:
        for _, _, it in iterator:
            data_batch = self.distribute_strategy.experimental_local_results(next(it))[0]
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _train_step(self, data):
    """Keras's TensorFlow ``train_step`` with each replica's loss weighted by its
    share of the global batch (``n_local * N / n_global``; 1 for an even split).
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    n_local = tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]
    n_global = tf.distribute.get_replica_context().all_reduce("sum", n_local)
    replicas = self.distribute_strategy.num_replicas_in_sync
    with tf.GradientTape() as tape:
        if self._call_has_training_arg:
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=n_local
        )
        share = tf.cast(n_local * replicas, loss.dtype) / tf.cast(n_global, loss.dtype)
        loss = self.optimizer.scale_loss(loss * share)
    if self.trainable_weights:
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

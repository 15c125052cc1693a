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
        if len(names) == 1:
            self.strategy = tf.distribute.OneDeviceStrategy(names[0])
            self.name = "tf.distribute.OneDeviceStrategy"
        else:
            # NCCL serves GPUs; logical CPU devices need a plain reduction.
            ops = tf.distribute.ReductionToOneDevice() if kind == "CPU" else None
            self.strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)

    def scope(self):
        return self.strategy.scope()

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


def _symbolic_build(self, iterator=None, data_batch=None):
    """Keras builds metrics and optimizer from the first batch, averaged over replicas,
    which fails when the first batch splits unevenly. Only its shapes matter, so
    build from the first replica's part instead.
    """
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

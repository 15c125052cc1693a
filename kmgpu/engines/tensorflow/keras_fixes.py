"""Keras internals the TensorFlow engine uses or replaces, in one place.

Keras 3.15.1; each entry of ``PATCHES`` names the internal, and why.
``tests/unit/test_keras_fixes.py`` checks every name still exists.
"""

import contextlib

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica",
     "replaced during multi-worker calls: it reduces scalar metrics with axis=0, which "
     "fails (\"Invalid reduction dimension 0\", keras-team/keras#20585)"),
    ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker",
     "read by the replacement above"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer",
     "its train_step is replaced on replicas (train_step below) only where the user's "
     "model keeps Keras's own"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._symbolic_build",
     "symbolic_build below calls it on the first replica's part of the first batch: "
     "Keras averages the first batch over replicas, which fails when it splits unevenly"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution",
     "the loss tracker records the unscaled replica loss, as Keras's own train_step"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter",
     "fit on arrays fed as one repeating tf.data pipeline: Keras makes a new distributed "
     "iterator every epoch for arrays (~0.4 s per epoch under MirroredStrategy)"),
    ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays", "same"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split", "same"),
    ("keras.src.trainers.data_adapters.data_adapter_utils", "unpack_x_y_sample_weight",
     "same, and the weighted train_step"),
]


@contextlib.contextmanager
def reduce_fix(strategy):
    """Keras 3.15's TF trainer reduces multi-worker step outputs with
    ``strategy.reduce("MEAN", v, axis=0)``, which fails on scalar metrics
    ("Invalid reduction dimension 0 for input with 0 dimensions", keras #20585).
    Within the block, a mean over all replicas (``axis=None``) is used instead.
    """
    import keras
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(
                strategy):
            return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica
    try:
        yield
    finally:
        trainer.reduce_per_replica = original


def repeating_datasets(kwargs):
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


def symbolic_build(self, iterator=None, data_batch=None):
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


def train_step(self, data):
    """Keras's TensorFlow ``train_step`` with each replica's loss weighted by its
    share of the global batch (``n_local * N / n_global``; 1 for an even split).
    """
    import keras
    import tensorflow as tf
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    n_local = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
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


def keeps_keras_train_step(model):
    """True when ``model`` runs Keras's own TensorFlow ``train_step`` (not the user's)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return type(model).train_step is TensorFlowTrainer.train_step

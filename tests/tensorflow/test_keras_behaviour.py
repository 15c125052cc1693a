"""What Keras's TensorFlow backend does where kmgpu's TensorFlow patches act (the PATCHES
rows of kmgpu/engines/tensorflow/keras_fixes.py), checked on the installed Keras: a Keras
that changes one of these fails the test named for it (``relies_on``), not a version
guard. Rows still without a test here are listed in tests/unit/test_patches.py (NOT_YET)."""

import keras
import numpy as np
import tensorflow as tf

from kmgpu.engines import keras_fixes
from kmgpu.engines.tensorflow import step_fixes
from tests.helpers import tiny_mlp, tiny_xy, two_output_model
from tests.relies_on import relies_on


@relies_on(("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"))
def test_a_model_keeps_kerass_tf_steps_unless_its_class_overrides_them():
    class Own(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    assert step_fixes.keeps_keras_step(tiny_mlp(metrics=["mae"])) and step_fixes.keeps_keras_step(tiny_mlp(metrics=["mae"]), "test_step")
    own = Own([keras.Input((3,)), keras.layers.Dense(2)])
    assert not step_fixes.keeps_keras_step(own) and step_fixes.keeps_keras_step(own, "test_step")


@relies_on(("keras.src.trainers.trainer", "Trainer.compute_loss"))
def test_compute_loss_in_a_replica_is_divided_by_the_replicas():
    """exact_custom_steps replaces compute_loss on replicas of models with their own
    train_step: under tf.distribute Keras scales it by 1/N."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = tiny_xy(4)
    with strategy.scope():
        model = tiny_mlp(metrics=["mae"])
    y_pred = model(x)
    alone = float(model.compute_loss(x=x, y=y, y_pred=y_pred))
    per_replica = strategy.run(lambda: model.compute_loss(x=x, y=y, y_pred=model(x)))
    values = [float(v) for v in strategy.experimental_local_results(per_replica)]
    np.testing.assert_allclose(values, [alone / 2] * 2, rtol=1e-5)


@relies_on(("keras.src.trainers.compile_utils", "CompileLoss.call"),
           ("keras.src.metrics.reduction_metrics", "Mean.update_state"))
def test_an_outputs_loss_tracker_gets_the_batch_size_as_its_weight():
    """weigh_output_losses replaces CompileLoss.call on replicas: Keras records each
    output's loss in its Mean with sample_weight=y_pred.shape[0], None in a step traced
    for any batch size."""
    model = two_output_model()
    x = np.ones((5, 3), "float32")
    y = {"a": np.zeros((5, 1), "float32"), "b": np.ones((5, 1), "float32")}
    model._compile_loss(y, model(x))
    weights = []
    for t in model._compile_loss.metrics:
        keras_fixes.install(t, "update_state", lambda update: lambda v, sample_weight=None: (
            weights.append(sample_weight), update(v, sample_weight=sample_weight))[1])

    @tf.function(input_signature=[tf.TensorSpec((None, 3))] * 1)
    def traced(xs):
        ys = {"a": tf.zeros((tf.shape(xs)[0], 1)), "b": tf.ones((tf.shape(xs)[0], 1))}
        return model._compile_loss(ys, model(xs))

    traced(x)
    assert weights == [None, None]


@relies_on(("keras.src.utils.python_utils", "pythonify_logs"),
           ("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order"))
def test_logs_as_python_numbers_in_metrics_names_order():
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    logs = model.train_on_batch(x, y, return_dict=True)
    from keras.src.utils.python_utils import pythonify_logs

    plain = pythonify_logs({"loss": tf.constant(1.5)})
    assert plain == {"loss": 1.5} and isinstance(plain["loss"], float)
    assert model._flatten_metrics_in_order(logs) == [logs["loss"], logs["mae"]]


@relies_on(("keras.src.trainers.trainer", "Trainer._get_metrics_result_or_logs"),
           ("keras.src.trainers.trainer", "Trainer.get_metrics_result"),
           ("keras.src.trainers.trainer", "Trainer.reset_metrics"))
def test_logs_come_from_the_metric_variables_when_the_keys_match():
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    results = model.get_metrics_result()
    assert set(results) == {"loss", "mae"}
    out = model._get_metrics_result_or_logs({k: -1.0 for k in results})
    assert all(float(out[k]) != -1.0 for k in out)
    other = {"something_else": 3.0}
    assert model._get_metrics_result_or_logs(other) is other
    model.reset_metrics()
    assert all(float(np.sum(v.numpy())) == 0.0 for m in model.metrics for v in m.variables)


@relies_on(("keras.src.trainers.data_adapters.array_data_adapter", "ArrayDataAdapter"),
           ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays"),
           ("keras.src.trainers.data_adapters.data_adapter_utils", "unpack_x_y_sample_weight"),
           ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"),
           ("keras.src.trainers.data_adapters.tf_dataset_adapter", "TFDatasetAdapter"))
def test_arrays_and_datasets_are_read_by_kerass_adapters():
    from keras.src.trainers.data_adapters import (array_data_adapter, array_slicing,
                                                   data_adapter_utils, tf_dataset_adapter)

    x, y = tiny_xy(10)
    assert array_data_adapter.can_convert_arrays((x, y))
    assert not array_data_adapter.can_convert_arrays((iter([x]),))
    adapter = array_data_adapter.ArrayDataAdapter(x, y, batch_size=4, shuffle=False)
    assert adapter.num_batches == 3
    first = next(iter(adapter.get_tf_dataset()))
    np.testing.assert_array_equal(first[0].numpy(), x[:4])
    assert data_adapter_utils.unpack_x_y_sample_weight((x, y, 3)) == (x, y, 3)
    assert data_adapter_utils.unpack_x_y_sample_weight((x,))[1:] == (None, None)
    (_, yt), (_, yv) = array_slicing.train_validation_split((x, y), validation_split=0.2)
    assert len(yt) == 8 and len(yv) == 2
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
    assert tf_dataset_adapter.TFDatasetAdapter(ds).get_tf_dataset() is ds


@relies_on(("tensorflow.python.eager.context", "global_seed"))
def test_the_global_seed_is_what_tf_random_set_seed_set():
    from tensorflow.python.eager import context

    before = context.global_seed()
    try:
        tf.random.set_seed(1234)
        assert context.global_seed() == 1234
    finally:
        tf.random.set_seed(before)


class _AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(tf.reduce_sum(x))
        return x


@relies_on(("keras.src.layers.layer", "Layer._losses"),
           ("keras.src.layers.layer", "Layer.add_loss"),
           ("keras.src.layers.layer", "Layer._get_own_losses"),
           ("keras.src.layers.layer", "Layer._clear_losses"))
def test_a_layer_keeps_its_calls_losses_in_one_list():
    """per_thread_losses gives each replica thread its own _losses: add_loss appends to
    it, _get_own_losses reads it and _clear_losses (at the start of a call) empties it."""
    layer = _AddsLoss()
    layer(tf.ones((2, 2)))
    assert isinstance(layer._losses, list) and len(layer._losses) == 1
    assert float(layer._get_own_losses()[0]) == 4.0
    layer.add_loss(tf.constant(1.0))
    assert len(layer._losses) == 2
    layer._clear_losses()
    assert layer._losses == []


@relies_on(("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments"))
def test_batchnorm_in_training_takes_its_moments_from_moments():
    layer = keras.layers.BatchNormalization(epsilon=0.0, center=False, scale=False)
    x = np.random.default_rng(0).normal(size=(6, 2)).astype("float32")
    layer.build(x.shape)
    keras_fixes.install(layer, "_moments", lambda original: lambda inputs, mask: (
        tf.zeros(2), tf.fill((2,), 4.0)))
    np.testing.assert_allclose(layer(x, training=True).numpy(), x / 2, rtol=1e-5)


@relies_on(("keras.src.optimizers.base_optimizer", "BaseOptimizer._clip_gradients"))
def test_clipping_happens_in_clip_gradients():
    opt = keras.optimizers.SGD(global_clipnorm=1.0)
    grads = [tf.constant([3.0, 4.0])]
    np.testing.assert_allclose(opt._clip_gradients(grads)[0].numpy(), [0.6, 0.8], rtol=1e-6)


@relies_on(("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer.check_finite"))
def test_check_finite_is_false_for_any_inf_or_nan():
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert bool(opt.check_finite([tf.constant([1.0, 2.0])]))
    assert not bool(opt.check_finite([tf.constant([1.0]), tf.constant([np.inf])]))


@relies_on(("keras.src.backend.tensorflow.trainer", "reduce_per_replica"),
           ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker"))
def test_step_outputs_are_reduced_by_reduce_per_replica():
    """reduce_fix swaps reduce_per_replica(values, strategy, reduction) for multi-worker
    strategies, which _collective_all_reduce_multi_worker tells: a MirroredStrategy is
    not one, and its per-replica values are reduced (first replica's, for "auto")."""
    from keras.src.backend.tensorflow import trainer

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert not trainer._collective_all_reduce_multi_worker(strategy)
    values = strategy.run(lambda: {"loss": tf.constant(2.0)})
    out = trainer.reduce_per_replica(values, strategy, "auto")
    assert float(out["loss"]) == 2.0


@relies_on(("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._symbolic_build"),
           ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._maybe_symbolic_build"))
def test_the_first_call_builds_through_maybe_symbolic_build():
    """kmgpu puts symbolic_build in the replica's _maybe_symbolic_build (which
    train_on_batch calls first) and calls _symbolic_build(data_batch=...) from it."""
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    called = []
    keras_fixes.install(model, "_maybe_symbolic_build", lambda original: lambda *a, **k: (
        called.append(1), original(*a, **k))[1])
    model.train_on_batch(x, y)
    assert called and model._compile_metrics.built
    other = tiny_mlp(metrics=["mae"])
    other._symbolic_build(data_batch=(x[:4], y[:4]))
    assert other._compile_metrics.built and other.optimizer.built


@relies_on(("keras.src.backend.tensorflow.trainer", "TFEpochIterator._get_iterator"))
def test_each_epoch_iterates_through_get_iterator():
    """park_iterators wraps TFEpochIterator._get_iterator: Keras makes the epoch's
    iterator there."""
    from keras.src.backend.tensorflow import trainer

    x, y = tiny_xy()
    it = trainer.TFEpochIterator(distribute_strategy=tf.distribute.get_strategy(), x=x, y=y,
                                 batch_size=4, shuffle=False)
    made = []
    original = it._get_iterator
    it._get_iterator = lambda: made.append(1) or original()
    steps = [step for step, *_ in it]
    assert made and len(steps) >= 1


@relies_on(("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer._tf_apply"),
           ("keras.src.optimizers.loss_scale_optimizer",
            "LossScaleOptimizer._stateful_handle_finite_grads"),
           ("keras.src.optimizers.loss_scale_optimizer",
            "LossScaleOptimizer._stateful_handle_non_finite_grads"))
def test_loss_scale_apply_skips_non_finite_gradients_and_halves_the_scale():
    """finite_over_replicas replaces _tf_apply on replicas and calls the two handlers as
    it does: finite gradients are applied, non-finite ones skipped with the scale halved."""
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                              initial_scale=8.0)
    v = keras.Variable([1.0])
    opt.build([v])
    seen = []
    for name in ("_tf_apply", "_stateful_handle_finite_grads",
                 "_stateful_handle_non_finite_grads"):
        keras_fixes.install(opt, name, lambda original, name=name: lambda *a, **k: (
            seen.append(name), original(*a, **k))[1])
    opt.apply([tf.constant([np.inf])], [v])
    assert float(v.numpy()[0]) == 1.0 and float(opt.dynamic_scale.numpy()) == 4.0
    opt.apply([tf.constant([4.0])], [v])  # unscaled by 4: 1.0, times lr 0.5
    np.testing.assert_allclose(v.numpy(), [0.5])
    assert seen == ["_tf_apply", "_stateful_handle_non_finite_grads",
                    "_tf_apply", "_stateful_handle_finite_grads"]


@relies_on(("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply"),
           ("tensorflow", "__internal__.distribute.interim.maybe_merge_call"))
def test_train_steps_update_through_the_optimizers_apply():
    """accumulate_across_replicas replaces apply on replica optimizers (train_step's
    apply_gradients calls it), and swaps maybe_merge_call(fn, strategy, *args), which
    calls fn(strategy, *args) where no merge is needed."""
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    calls = []
    model.optimizer.build(model.trainable_variables)
    keras_fixes.install(model.optimizer, "apply", lambda original: lambda *a, **k: (
        calls.append(1), original(*a, **k))[1])
    model.train_on_batch(x, y)
    assert calls
    merge = tf.__internal__.distribute.interim.maybe_merge_call
    assert merge(lambda strategy, a: a + 1, tf.distribute.get_strategy(), 1) == 2


@relies_on(("keras.src.backend.tensorflow.optimizer", "TFOptimizer._all_reduce_sum_gradients"))
def test_gradients_are_summed_over_replicas_by_all_reduce_sum_gradients():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        v = keras.Variable([0.0])
        opt = keras.optimizers.SGD()

    def step():
        ctx = tf.distribute.get_replica_context()
        g = tf.constant([1.0]) * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        return opt._all_reduce_sum_gradients([(g, v)])[0][0]  # (gradient, variable) pairs

    out = strategy.experimental_local_results(strategy.run(tf.function(step)))
    assert [float(o.numpy()[0]) for o in out] == [3.0, 3.0]


@relies_on(("tensorflow.python.distribute.distribute_lib", "ReplicaContextBase.all_reduce"),
           ("tensorflow.python.ops.custom_gradient", "_graph_mode_decorator"),
           ("tensorflow.python.ops.custom_gradient", "_get_dependent_variables"))
def test_a_traced_all_reduce_is_a_custom_gradient_that_searches_for_variables():
    """all_reduce_without_walk recognises all_reduce's grad_wrapper in
    _graph_mode_decorator(f, args, kwargs) and skips _get_dependent_variables for it."""
    from tensorflow.python.ops import custom_gradient

    names, searched = [], []
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with keras_fixes.swapped(
            (custom_gradient, "_graph_mode_decorator", lambda decorate: lambda f, a, k: (
                names.append(getattr(f, "__qualname__", "")), decorate(f, a, k))[1]),
            (custom_gradient, "_get_dependent_variables",
             lambda dep: lambda input_ops, output_ops: (
                 searched.append(1), dep(input_ops, output_ops))[1])):
        @tf.function
        def step():
            return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))

        out = strategy.experimental_local_results(strategy.run(step))
    assert [float(o) for o in out] == [2.0, 2.0]
    assert any(n.startswith("ReplicaContext") and ".all_reduce.<locals>." in n for n in names)
    assert searched


@relies_on(("tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset"),
           ("tensorflow.python.data.ops.multi_device_iterator_ops",
            "OwnedMultiDeviceIterator.__init__"))
def test_a_distributed_dataset_iterates_through_a_multi_device_iterator():
    """untuned_iterators wraps both: iterating a distributed dataset on several devices
    makes an OwnedMultiDeviceIterator and a per-device dataset for each device."""
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    made, inits = [], []
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4))
    with keras_fixes.swapped(
            (ops, "_create_device_dataset", lambda create: lambda *a, **k: (
                made.append(1), create(*a, **k))[1]),
            (ops.OwnedMultiDeviceIterator, "__init__", lambda init: lambda self, *a, **k: (
                inits.append(1), init(self, *a, **k))[1])):
        first = next(iter(ds))
    assert inits and len(made) >= 2
    assert [t.numpy().tolist() for t in strategy.experimental_local_results(first)] == [
        [0.0, 1.0], [2.0, 3.0]]

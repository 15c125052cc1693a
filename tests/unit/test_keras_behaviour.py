"""What Keras does where kmgpu's shared Keras patches act (the PATCHES rows of
kmgpu/engines/keras_fixes.py), checked on the installed Keras in every backend's session:
a Keras that changes one of these fails the test named for it (``relies_on``), not a
version guard. Each test is small: one Keras behaviour, on tiny models, no devices.
"""

import keras
import numpy as np
from keras import ops

from kmgpu.engines import keras_fixes, model_fixes
from tests.helpers import two_output_model
from tests.relies_on import relies_on


def _close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(ops.convert_to_numpy(a)),
                               np.asarray(ops.convert_to_numpy(b)), rtol=tol, atol=tol)


# -- saving ----------------------------------------------------------------------------
@relies_on(("keras.src.saving.saving_lib", "get_attr_skipset"),
           ("keras.src.backend.common.global_state", "set_global_attribute"))
def test_saving_reads_its_skip_set_cache_under_the_skiplist_name():
    """warm_saving fills the cache under "saving_attr_skiplist_<type>": the name
    get_attr_skipset reads, so a warmed cache is what saving uses."""
    from keras.src.backend.common import global_state
    from keras.src.saving import saving_lib

    name = "saving_attr_skiplist_Metric"
    before = global_state.get_global_attribute(name)
    mine = {"_kmgpu_probe"}
    global_state.set_global_attribute(name, mine)
    try:
        assert saving_lib.get_attr_skipset("Metric") is mine
    finally:
        global_state.set_global_attribute(name, before)


@relies_on(("keras.src.saving.serialization_lib", "tf"))
def test_serializing_asks_the_serializers_tf_whether_tensorflow_is_there():
    """serialize_without_tensorflow replaces serialization_lib.tf: serializing asks it
    (``tf.available``) rather than importing TensorFlow some other way."""
    from keras.src.saving import serialization_lib

    class Probe:
        asked = 0

        @property
        def available(self):
            Probe.asked += 1
            return False

    with keras_fixes.swapped((serialization_lib, "tf", lambda before: Probe())):
        config = serialization_lib.serialize_keras_object(
            {"shape": (2, 3), "dtype": "float32", "layer": keras.layers.Dense(2)})
    assert Probe.asked > 0 and list(config["shape"]) == [2, 3]


@relies_on(("keras.src.models.functional", "Functional"))
def test_functional_models_are_functional_and_subclassed_ones_are_not():
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))

    class Own(keras.Model):
        def call(self, x):
            return x

    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    assert model_fixes.is_functional(functional) and model_fixes.is_functional(sequential)
    assert not model_fixes.is_functional(Own())
    from keras.src.models.functional import Functional

    assert isinstance(functional, Functional) and not isinstance(Own(), Functional)


@relies_on(("keras.src.saving.saving_lib", "_save_state"),
           ("keras.src.saving.saving_lib", "_load_state"),
           ("keras.src.saving.saving_lib", "NpzIOStore"))
def test_the_saving_walk_carries_an_adapted_layers_state_its_config_does_not():
    """A Normalization layer adapted to data: its config and its weights rebuild a layer
    that is not finalized; Keras's saving walk (_save_state / _load_state, with the
    in-memory NpzIOStore subclass) carries the statistics and finalizes it."""
    data = np.arange(24, dtype="float32").reshape(8, 3)
    norm = keras.layers.Normalization()
    norm.adapt(data)
    model = keras.Sequential([keras.Input((3,)), norm])
    state = model_fixes.own_state(model)
    assert state is not None
    fresh = keras.Sequential.from_config(model.get_config())
    model_fixes.load_own_state(fresh, state)
    _close(fresh(data), model(data), 1e-5)
    _close(ops.mean(fresh(data), axis=0), np.zeros(3), 1e-5)  # finalized: normalizes


@relies_on(("keras.src.saving.saving_lib", "H5IOStore"),
           ("keras.src.saving.saving_lib", "ShardedH5IOStore"),
           ("keras.src.optimizers.base_optimizer", "BaseOptimizer.save_own_variables"))
def test_save_weights_writes_through_the_store_classes_it_looks_up(tmp_path):
    """save_weights makes its store from saving_lib's H5IOStore / ShardedH5IOStore as
    looked up at the call, and hands it each layer's variables themselves but the
    optimizer's values (variable.numpy()): ``save_weights_from`` swaps both, so every
    array, the optimizer's too, can come from elsewhere; Keras's own save writes the
    model's values and loads back into a model as they were."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    handed = []

    def value_of(variable):
        handed.append(variable)
        return np.full(tuple(variable.shape), 7, keras.backend.standardize_dtype(variable.dtype))

    for name, shard in (("a.weights.h5", None), ("a.weights.json", 1e-7)):
        handed.clear()
        model_fixes.save_weights_from(model, tmp_path / name, value_of, shard)
        assert {id(v) for v in handed} == {id(v) for v in model.weights
                                           + model.optimizer.variables}
        other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        other.compile(optimizer="adam", loss="mse")
        other.optimizer.build(other.trainable_variables)
        other.load_weights(tmp_path / name)
        for v in other.weights + other.optimizer.variables:
            _close(v, np.full(tuple(v.shape), 7))
    keras.Model.save_weights(model, tmp_path / "own.weights.h5")  # Keras's own again
    other.load_weights(tmp_path / "own.weights.h5")
    for a, b in zip(other.weights + other.optimizer.variables,
                    model.weights + model.optimizer.variables):
        _close(a, b)


@relies_on(("keras.src.saving.saving_lib", "_save_assets_to_dict"),
           ("keras.src.saving.saving_lib", "_load_assets_from_dict"))
def test_the_assets_walk_carries_a_lookup_vocabulary():
    """An IntegerLookup adapted to data keeps its vocabulary as an asset, outside its
    config: _save_assets_to_dict / _load_assets_from_dict carry it."""
    lookup = keras.layers.IntegerLookup()
    lookup.adapt(np.array([7, 7, 7, 3, 3, 9]))
    model = keras.Sequential([keras.Input((1,), dtype="int64"), lookup])
    state = model_fixes.own_state(model)
    assert state is not None and state[1] is not None  # the assets part
    fresh = keras.Sequential.from_config(model.get_config())
    model_fixes.load_own_state(fresh, state)
    probe = np.array([[7], [3], [9], [5]])
    assert ops.convert_to_numpy(fresh(probe)).tolist() == \
        ops.convert_to_numpy(model(probe)).tolist()
    assert fresh.layers[0].get_vocabulary() == lookup.get_vocabulary()


@relies_on(("keras.src.optimizers.base_optimizer", "BaseOptimizer.exclude_from_weight_decay"),
           ("keras.src.optimizers.base_optimizer", "BaseOptimizer._use_weight_decay"))
def test_weight_decay_exclusions_stay_out_of_the_optimizers_config():
    """exclude_from_weight_decay keeps its lists in private attributes, not in
    get_config(): a copy from the config decays everything (kmgpu carries them:
    optimizer_settings / apply_optimizer_settings)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    opt = keras.optimizers.AdamW(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_list=[bias], var_names=["nothing_named_so"])
    assert not opt._use_weight_decay(bias) and opt._use_weight_decay(kernel)
    copy = keras.optimizers.AdamW.from_config(opt.get_config())
    assert copy._use_weight_decay(bias)  # what kmgpu fixes
    model.compile(optimizer=opt, loss="mse")
    settings = model_fixes.optimizer_settings(model)
    assert settings["exclude_positions"] == [1]
    twin = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    twin.compile(optimizer=copy, loss="mse")
    model_fixes.apply_optimizer_settings(twin, settings)
    assert not copy._use_weight_decay(twin.layers[0].bias)
    assert copy._use_weight_decay(twin.layers[0].kernel)


# -- losses ----------------------------------------------------------------------------
def _regularized():
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.5),
                           activity_regularizer=keras.regularizers.L1(0.25))])
    model.compile(optimizer="sgd", loss="mse")
    return model


@relies_on(("keras.src.trainers.trainer", "Trainer.compute_loss"),
           ("keras.src.trainers.trainer", "Trainer._compute_loss"),
           ("keras.src.trainers.trainer", "Trainer._aggregate_additional_loss"))
def test_compute_loss_is_the_compiled_loss_plus_the_models_own_losses():
    """replica_loss computes Keras's compute_loss in its two parts: the compiled loss
    (_compile_loss) and each of model.losses through _aggregate_additional_loss."""
    model = _regularized()
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)
    y = np.ones((4, 2), "float32")
    y_pred = model(x, training=True)
    own = list(model.losses)
    assert len(own) == 2  # the kernel's and the activity's
    parts = model._compile_loss(y, y_pred) + sum(
        model._aggregate_additional_loss(loss) for loss in own)
    _close(model.compute_loss(x=x, y=y, y_pred=y_pred, training=True), parts, 1e-5)
    _close(model._compute_loss(x=x, y=y, y_pred=y_pred, training=True), parts, 1e-5)


@relies_on(("keras.src.losses.loss", "reduce_weighted_values"),
           ("keras.src.losses.loss", "apply_mask"),
           ("keras.src.losses.loss", "squeeze_or_expand_to_same_rank"))
def test_a_masked_mean_divides_by_the_valid_entries():
    """masked_losses reweighs a replica's masked mean because Keras divides a masked
    loss by its valid entries, not the batch size (with sample weights and
    "mean_with_sample_weight": by the valid entries' weights); it calls these three with
    the arguments below, positionally."""
    from keras.src.losses import loss as losses

    values = np.array([1.0, 2.0, 3.0, 4.0], "float32")
    mask = np.array([True, True, False, False])
    _close(losses.reduce_weighted_values(values, None, mask, "sum_over_batch_size",
                                         "float32"), 1.5)
    _close(losses.reduce_weighted_values(values, None, None, "sum_over_batch_size",
                                         "float32"), 2.5)
    weights = np.array([1.0, 3.0, 5.0, 7.0], "float32")
    _close(losses.reduce_weighted_values(values, weights, mask, "mean_with_sample_weight",
                                         "float32"), (1 + 6) / 4)
    applied = losses.apply_mask(weights, ops.convert_to_tensor(mask, "float32"),
                                dtype="float32", reduction="mean_with_sample_weight")
    _close(applied, [1.0, 3.0, 0.0, 0.0])
    a, b = losses.squeeze_or_expand_to_same_rank(ops.ones((4, 1)), ops.ones((4,)))
    assert len(a.shape) == len(b.shape)


@relies_on(("keras.src.trainers.compile_utils", "CompileLoss.metrics"),
           ("keras.src.metrics.reduction_metrics", "Mean.update_state"))
def test_each_outputs_loss_tracker_is_a_mean_updated_with_the_outputs_loss():
    """With several outputs, CompileLoss keeps one Mean per output (its metrics) and
    calls its update_state(value, sample_weight=rows) at each call: what kmgpu wraps on
    a replica's trackers."""
    model = two_output_model()
    x = np.ones((5, 3), "float32")
    y = {"a": np.zeros((5, 1), "float32"), "b": np.ones((5, 1), "float32")}
    y_pred = model(x)
    model._compile_loss(y, y_pred)  # builds it
    trackers = model._compile_loss.metrics
    assert len(trackers) == 2 and all(isinstance(t, keras.metrics.Mean) for t in trackers)
    seen = []
    for t in trackers:
        keras_fixes.install(t, "update_state", lambda update: lambda values, sample_weight=None: (
            seen.append((float(ops.convert_to_numpy(values)), sample_weight)),
            update(values, sample_weight=sample_weight))[1])
    total = model._compile_loss(y, y_pred)
    assert len(seen) == 2 and all(int(w) == 5 for _, w in seen)
    _close(sum(v for v, _ in seen), total, 1e-5)


# -- data --------------------------------------------------------------------------------
class _Rows(keras.utils.PyDataset):
    def __init__(self):
        super().__init__()

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return np.full((2, 1), i, "float32"), np.array([0, 1])


@relies_on(("keras.src.trainers.data_adapters.py_dataset_adapter",
            "PyDatasetAdapter._get_iterator"),
           ("keras.src.trainers.data_adapters.data_adapter_utils",
            "class_weight_to_sample_weights"))
def test_a_pydataset_pass_yields_its_batches_with_class_weights():
    """py_dataset_pass reads a PyDataset through Keras's adapter (_get_iterator: the
    batches in order without shuffle) and class_weight_to_sample_weights maps a
    batch's class ids to weights."""
    from kmgpu.engines import data_fixes

    batches = list(data_fixes.py_dataset_pass(_Rows(), class_weight={0: 1.0, 1: 3.0}))
    assert [int(np.asarray(b[0])[0, 0]) for b in batches] == [0, 1, 2]
    assert all(np.asarray(b[2]).tolist() == [1.0, 3.0] for b in batches)
    from keras.src.trainers.data_adapters import data_adapter_utils

    assert np.asarray(data_adapter_utils.class_weight_to_sample_weights(
        np.array([[1], [0], [1]]), {0: 0.5, 1: 2.0})).tolist() == [2.0, 0.5, 2.0]

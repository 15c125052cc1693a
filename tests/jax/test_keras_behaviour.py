"""What Keras's JAX backend does where kmgpu's JAX patches act (the PATCHES rows of
kmgpu/engines/jax/keras_fixes.py), checked on the installed Keras: a Keras that changes
one of these fails the test named for it (``relies_on``), not a version guard."""

import jax
import keras
import numpy as np
from keras import ops

from kmgpu.engines import keras_fixes
from kmgpu.engines.jax import layer_fixes, optimizer_fixes
from tests.helpers import tiny_mlp, tiny_xy
from tests.relies_on import relies_on


@relies_on(("keras.src.backend.jax.trainer", "_distribute_data"))
def test_the_jax_trainer_places_every_batch_through_distribute_data():
    """replicate_indivisible swaps the module-level _distribute_data(data, layouts):
    under a distribution, Keras's JAX trainer places each batch through it."""
    from keras.src.backend.jax import trainer as jax_trainer

    dist = keras.distribution.DataParallel(devices=jax.devices()[:2])
    calls = []

    def recording(original):
        def distribute(data, layouts=None):
            calls.append(len(keras.tree.flatten(data)))
            return original(data, layouts)
        return distribute

    with dist.scope():
        model = tiny_mlp()
        x, y = tiny_xy()
        with keras_fixes.swapped((jax_trainer, "_distribute_data", recording)):
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert len(calls) >= 2


@relies_on(("keras.src.backend.jax.trainer", "JAXTrainer.predict_step"))
def test_predict_runs_the_models_own_predict_step_with_state_and_data():
    """replicated_predictions installs predict_step(state, data) -> (outputs, state) on
    the replica: Keras's predict calls the instance's."""
    model = tiny_mlp()
    x, _ = tiny_xy()
    want = model.predict(x, verbose=0)
    calls = []

    def doubling(step):
        def predict_step(state, data):
            calls.append(1)
            outputs, non_trainable = step(state, data)
            return outputs * 2, non_trainable
        return predict_step

    keras_fixes.install(model, "predict_step", doubling)
    model.predict_function = None
    np.testing.assert_allclose(model.predict(x, verbose=0), 2 * want, rtol=1e-6)
    assert calls


class _AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(ops.mean(x) * 0.0 + 1.0)
        return x


@relies_on(("keras.src.layers.layer", "Layer.stateless_call"),
           ("keras.src.layers.layer", "Layer._clear_losses"))
def test_the_steps_enter_through_stateless_call_and_loss_ids_outlive_a_trace():
    """fresh_loss_ids wraps the model's stateless_call (the entry of the JAX trainer's
    steps) because a layer's _loss_ids, which _clear_losses reads, keep the id()s of
    the losses of a call after it ends."""
    model = keras.Sequential([keras.Input((3,)), _AddsLoss(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    entered = []
    keras_fixes.install(model, "stateless_call", lambda original: lambda *a, **k: (
        entered.append(1), original(*a, **k))[1])
    x, y = tiny_xy()
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert entered and np.isfinite(history.history["loss"][0])
    layer = model.layers[0]
    layer._loss_ids.clear()
    model.stateless_call(model.trainable_variables, model.non_trainable_variables, x,
                         return_losses=True)
    assert layer._loss_ids  # kept after the call
    layer._clear_losses()
    assert not layer._loss_ids


@relies_on(("keras.src.layers.normalization.batch_normalization", "BatchNormalization.call"))
def test_local_batchnorm_on_one_device_is_keras_batchnorm():
    """local_batchnorm replaces call on the replica's layers with kmgpu's arithmetic,
    Keras's own (it reads axis, momentum, epsilon, center, scale, gamma, beta and the
    moving statistics): on a mesh of one device both give the same outputs and moving
    statistics, with and without a mask."""
    x = np.random.default_rng(0).normal(size=(8, 5, 3)).astype("float32")
    mask = np.ones((8, 5), bool)
    mask[:, 3:] = False

    def model():
        m = keras.Sequential([keras.Input((5, 3)),
                              keras.layers.BatchNormalization(momentum=0.8, epsilon=1e-3)])
        m.layers[0].gamma.assign(np.array([1.0, 2.0, 0.5], "float32"))
        m.layers[0].beta.assign(np.array([0.1, -0.2, 0.3], "float32"))
        return m

    dist = keras.distribution.DataParallel(devices=jax.devices()[:1])
    for m_ in (None, mask):
        with dist.scope():
            mine, keras_own = model(), model()
            assert layer_fixes.local_batchnorm(mine, dist) == (1, [])
            got = mine.layers[0](x, training=True, mask=m_)
            want = keras_own.layers[0](x, training=True, mask=m_)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        for a, b in zip(mine.layers[0].non_trainable_variables,
                        keras_own.layers[0].non_trainable_variables):
            np.testing.assert_allclose(a.value, b.value, rtol=2e-5, atol=2e-6)


@relies_on(("keras.src.layers.layer", "Layer._track_variable"))
def test_stateful_rnn_states_are_untracked_until_tracked():
    """track_states tracks a stateful RNN's states (Keras creates them untracked, so the
    JAX trainer's jitted steps would not carry them)."""
    model = keras.Sequential([keras.Input((4, 2), batch_size=4),
                              keras.layers.LSTM(3, stateful=True)])
    layer = model.layers[0]
    states = keras.tree.flatten(layer.states)
    ids = {id(v) for v in model.non_trainable_variables}
    assert states and not any(id(v) in ids for v in states)
    dist = keras.distribution.DataParallel(devices=jax.devices()[:2])
    layer_fixes.track_states(model, dist)
    ids = {id(v) for v in model.non_trainable_variables}
    assert all(id(v) in ids for v in states)


@relies_on(("keras.src.optimizers.base_optimizer", "BaseOptimizer.add_variable_from_reference"),
           ("keras.src.optimizers.base_optimizer", "BaseOptimizer.add_variable"))
def test_slots_are_made_through_the_optimizers_own_add_variable_with_a_layout():
    """lay_out_optimizer installs add_variable on the optimizer: Keras's
    add_variable_from_reference (each slot) calls the instance's, with layout=."""
    model = tiny_mlp()
    opt = keras.optimizers.Adam()
    seen = []
    optimizer_fixes.lay_out_optimizer(opt, lambda shape: seen.append(shape) or None)
    opt.build(model.trainable_variables)
    slots = sorted(shape for shape in seen if shape)  # not the () counters
    assert slots == sorted([(3, 2), (2,)] * 2)  # momentum and velocity of each


@relies_on(("keras.src.backend.jax.core", "JaxVariable._direct_assign"))
def test_assigning_places_the_value_by_the_variables_layout():
    """lay_out_optimizer re-lays an existing variable by setting _layout and assigning
    its value again: assign places it by the layout."""
    dist = keras.distribution.DataParallel(devices=jax.devices()[:2])
    with dist.scope():
        v = keras.Variable(np.arange(8, dtype="float32").reshape(4, 2))
        v._layout = keras.distribution.TensorLayout([dist.batch_dim_name, None],
                                                    dist.device_mesh)
        v.assign(v.value)
    shards = v.value.addressable_shards
    assert len(shards) == 2 and shards[0].data.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(v.value), np.arange(8).reshape(4, 2))


@relies_on(("keras.src.optimizers.base_optimizer",
            "BaseOptimizer._overwrite_model_variables_with_average_value"))
def test_fit_with_ema_overwrites_through_the_optimizers_method_sharing_buffers():
    """separate_ema_overwrite wraps it on the replica's optimizer: fit with use_ema calls
    the instance's at its end, with the trainable variables, and leaves each variable
    holding its average's own array (the next donated step would get it twice)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(use_ema=True), loss="mse")
    calls = []
    name = "_overwrite_model_variables_with_average_value"
    keras_fixes.install(model.optimizer, name, lambda original: lambda variables: (
        calls.append(len(variables)), original(variables))[1])
    x, y = tiny_xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert calls == [2]
    averages = model.optimizer._model_variables_moving_average
    assert model.layers[0].kernel.value is averages[0].value  # one buffer for both

    fixed = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    fixed.compile(optimizer=keras.optimizers.SGD(use_ema=True), loss="mse")
    optimizer_fixes.separate_ema_overwrite(fixed.optimizer)
    for _ in range(2):  # the second fit's donated step gets distinct buffers
        fixed.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert fixed.layers[0].kernel.value is not \
        fixed.optimizer._model_variables_moving_average[0].value


@relies_on(("keras.src.optimizers.base_optimizer", "BaseOptimizer.stateless_apply"))
def test_the_train_step_hands_the_gradients_to_the_optimizers_stateless_apply():
    """constrain_gradients wraps it on the replica's optimizer: Keras's JAX train step
    calls the instance's stateless_apply with one gradient per trainable variable, of its
    shape, and applies what it returns."""
    model = tiny_mlp()
    calls = []

    def recording(original):
        def stateless_apply(optimizer_variables, grads, trainable_variables):
            calls.append([tuple(g.shape) for g in grads])
            return original(optimizer_variables, [g * 0 for g in grads], trainable_variables)
        return stateless_apply

    keras_fixes.install(model.optimizer, "stateless_apply", recording)
    before = model.get_weights()
    x, y = tiny_xy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert calls == [[(3, 2), (2,)]]  # traced once
    for a, b in zip(before, model.get_weights()):  # zero gradients: SGD leaves them
        np.testing.assert_array_equal(a, b)


@relies_on(("keras.src.backend.jax.core", "JaxVariable._initialize_layout"))
def test_a_new_variable_takes_its_layout_from_the_distributions_get_variable_layout():
    """zero.Distribution overrides get_variable_layout: a layer's weights made in its scope
    are placed by the layout it answers (the (3, 2) kernel and the bias of 2 halved over
    2 devices); an integer variable stays whole."""
    from kmgpu.engines.jax import zero

    dist = zero.Distribution(jax.devices()[:2])
    with dist.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        counter = keras.Variable(np.zeros((2,), "int32"))
    for v in (layer.kernel, layer.bias):
        assert [s.data.shape[-1] for s in v.value.addressable_shards] == [1, 1], v.path
    assert counter.value.sharding.is_fully_replicated


@relies_on(("keras.src.backend.common.variables", "Variable.value"),
           ("keras.src.backend.jax.core", "JaxVariable._direct_assign"))
def test_keras_reads_a_variable_through_value_and_assigns_through_direct_assign():
    """optimizer_fixes.hold: a held variable is read (np.asarray, numpy(), an op, saving
    the model, a plain fit's state) only through its value property, and an assign lets it
    go unread."""
    model = tiny_mlp()
    model.compile(optimizer="adam", loss="mse")
    x, y = tiny_xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    v = model.optimizer.variables[2]  # a moment
    reads = []

    def hold():
        optimizer_fixes.hold(v, v.value, lambda a: (reads.append(1), a + 1)[1])

    before = np.asarray(v.value)
    for read in (np.asarray, lambda v: v.numpy(), lambda v: ops.add(v, 0.0)):
        hold()
        np.testing.assert_array_equal(np.asarray(read(v)), before + 1)
        assert not optimizer_fixes.held(v)
        v.assign(before)
    assert len(reads) == 3
    hold()
    v.assign(before * 2)  # unread: let go
    assert len(reads) == 3 and not optimizer_fixes.held(v)
    np.testing.assert_array_equal(np.asarray(v.value), before * 2)

    import tempfile

    hold()
    with tempfile.TemporaryDirectory() as d:
        model.save(f"{d}/m.keras")
    assert len(reads) == 4 and not optimizer_fixes.held(v)
    hold()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert len(reads) == 5 and not optimizer_fixes.held(v)


@relies_on(("keras.src.backend.jax.trainer", "jit"),
           ("keras.src.backend.jax.trainer", "JAXTrainer.make_train_function"))
def test_make_train_function_jits_the_step_through_the_trainer_modules_jit():
    """step_fixes.compile_with swaps the module-level jit while the model's
    make_train_function (test, predict) runs: Keras jits the step through it then, with
    keyword arguments only besides the step."""
    from keras.src.backend.jax import trainer as jax_trainer

    model = tiny_mlp()
    x, y = tiny_xy()
    calls = []

    def recording(original):
        def jit(fun, **kwargs):
            calls.append(sorted(kwargs))
            return original(fun, **kwargs)
        return jit

    with keras_fixes.swapped((jax_trainer, "jit", recording)):
        model.make_train_function(force=True)
        model.make_test_function(force=True)
        model.make_predict_function(force=True)
    assert len(calls) == 3 and all("donate_argnums" in c for c in calls[:1]), calls
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # the jitted step runs

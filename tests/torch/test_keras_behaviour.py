"""What Keras's torch backend does where kmgpu's torch patches act (the PATCHES rows of
kmgpu/engines/torch/keras_fixes.py), checked on the installed Keras: a Keras that changes
one of these fails the test named for it (``relies_on``), not a version guard. Rows still
without a test here are listed in tests/unit/test_patches.py (NOT_YET)."""

import keras
import numpy as np
import torch

from kmgpu.engines import keras_fixes
from kmgpu.engines.torch import step_fixes
from tests.helpers import tiny_mlp, tiny_xy
from tests.relies_on import relies_on


class _OwnSteps(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)

    def test_step(self, data):
        return super().test_step(data)

    def predict_step(self, data):
        return super().predict_step(data)


@relies_on(("keras.src.backend.torch.trainer", "TorchTrainer.train_step"),
           ("keras.src.backend.torch.trainer", "TorchTrainer.test_step"),
           ("keras.src.backend.torch.trainer", "TorchTrainer.predict_step"))
def test_a_model_keeps_kerass_steps_unless_its_class_overrides_them():
    """The class's step is TorchTrainer's own unless the model's class defines one."""
    plain, own = tiny_mlp(metrics=["mae"]), _OwnSteps([keras.Input((3,)), keras.layers.Dense(2)])
    assert not any(f(plain) for f in (step_fixes.has_own_train_step,
                                      step_fixes.has_own_test_step,
                                      step_fixes.has_own_predict_step))
    assert all(f(own) for f in (step_fixes.has_own_train_step,
                                step_fixes.has_own_test_step,
                                step_fixes.has_own_predict_step))


@relies_on(("keras.src.trainers.trainer", "Trainer._compute_loss"))
def test_kerass_torch_train_step_computes_its_loss_through_compute_loss():
    """kmgpu's steps compute the loss as Keras's do: train_on_batch's loss is what
    _compute_loss gives for the batch."""
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    with torch.no_grad():
        before = float(step_fixes.compute_loss(model, x, y, model(x, training=True), None,
                                               True))
    logs = model.train_on_batch(x, y, return_dict=True)
    assert abs(logs["loss"] - before) < 1e-6


@relies_on(("keras.src.backend.torch.trainer", "TorchTrainer._get_metrics_result_or_logs"))
def test_logs_are_the_metric_variables_when_the_keys_match():
    """Keras turns metric variables into logs here: when the step's logs have the
    metrics' keys it returns the metrics' results (read from the variables), else the
    step's logs as they are."""
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    results = model.get_metrics_result()
    stale = {k: -1.0 for k in results}
    out = model._get_metrics_result_or_logs(stale)
    assert set(out) == set(results) and all(float(out[k]) != -1.0 for k in out)
    other = {"something_else": 3.0}
    assert model._get_metrics_result_or_logs(other) is other


@relies_on(("keras.src.trainers.trainer", "Trainer._flatten_metrics_in_order"))
def test_train_on_batch_lists_logs_in_metrics_names_order():
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    logs = model.train_on_batch(x, y, return_dict=True)
    flat = model._flatten_metrics_in_order(logs)
    assert flat == [logs[k] for k in ("loss", "mae")]


@relies_on(("keras.src.backend.torch.trainer", "TorchTrainer.evaluate"))
def test_fits_validation_runs_the_models_evaluate():
    """kmgpu wraps evaluate on each replica: fit's validation calls the instance's."""
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    calls = []
    keras_fixes.install(model, "evaluate", lambda original: lambda *a, **k: (
        calls.append(1), original(*a, **k))[1])
    model.fit(x, y, batch_size=4, epochs=2, validation_data=(x, y), verbose=0)
    assert len(calls) == 2
    assert step_fixes.keras_evaluate(model).__func__ is type(model).evaluate


@relies_on(("keras.src.utils.python_utils", "pythonify_logs"))
def test_pythonify_logs_makes_tensors_python_numbers():
    out = step_fixes.pythonify_logs({"loss": torch.tensor(1.5), "n": np.float32(2.0)})
    assert out == {"loss": 1.5, "n": 2.0} and isinstance(out["loss"], float)


@relies_on(("keras.src.utils", "is_default"))
def test_is_default_tells_kerass_do_nothing_hooks_from_a_users():
    class Mine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            pass

    cb = Mine()
    assert step_fixes.is_default(cb.on_train_batch_end)
    assert not step_fixes.is_default(cb.on_epoch_end)


@relies_on(("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"))
def test_validation_split_takes_the_last_rows_unshuffled():
    from keras.src.trainers.data_adapters import array_slicing

    x, y = np.arange(10.0).reshape(10, 1), np.arange(10.0)
    (xt, yt), (xv, yv) = array_slicing.train_validation_split((x, y), validation_split=0.3)
    assert np.asarray(yt).tolist() == list(range(7)) and np.asarray(yv).tolist() == [7, 8, 9]


@relies_on(("keras.src.trainers.trainer", "Trainer.jit_compile"))
def test_jit_compile_is_a_settable_model_property():
    """capture_fixes reads compile(jit_compile=True) and sets it False on the model that
    runs kmgpu's step."""
    model = tiny_mlp(metrics=["mae"], jit_compile=True)
    assert model.jit_compile is True
    model.jit_compile = False
    assert model.jit_compile is False


@relies_on(("keras.src.trainers.trainer", "Trainer._symbolic_build"))
def test_symbolic_build_builds_the_compiled_metrics_from_a_batch():
    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    assert not model._compile_metrics.built
    model._symbolic_build(data_batch=(x[:4], y[:4]))
    assert model._compile_metrics.built


@relies_on(("keras.src.layers.normalization.batch_normalization", "BatchNormalization._moments"))
def test_batchnorm_in_training_takes_its_moments_from_moments():
    """global_batch_moments replaces _moments(inputs, mask) on each replica's layer: the
    training call normalizes by what it returns."""
    layer = keras.layers.BatchNormalization(epsilon=0.0, center=False, scale=False)
    x = np.random.default_rng(0).normal(size=(6, 2)).astype("float32")
    layer.build(x.shape)
    keras_fixes.install(layer, "_moments", lambda original: lambda inputs, mask: (
        torch.zeros(2), torch.full((2,), 4.0)))
    out = layer(x, training=True)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out), x / 2, rtol=1e-5)


# -- what CUDA-graph capture refuses (capture_fixes, cond_fixes) ---------------------------
@relies_on(("keras.src.backend.torch.random", "normal"),
           ("keras.src.backend.torch.random", "uniform"),
           ("keras.src.backend.torch.random", "randint"),
           ("keras.src.backend.torch.random", "dropout"),
           ("keras.src.backend.torch.random", "shuffle"),
           ("keras.src.backend.torch.random", "categorical"),
           ("keras.src.backend.torch.random", "_get_concrete_noise_shape"))
def test_every_seeded_torch_draw_seeds_a_new_generator_on_the_host(monkeypatch):
    """device_random swaps these because each draw with a SeedGenerator makes a
    torch.Generator seeded from a host integer (torch_seed_generator), which capture
    refuses; Dropout's noise shape comes from _get_concrete_noise_shape."""
    from keras.src.backend.torch import random as torch_random

    made = []
    original = torch_random.torch_seed_generator
    monkeypatch.setattr(torch_random, "torch_seed_generator",
                        lambda seed: made.append(1) or original(seed))
    seed = keras.random.SeedGenerator(3)
    x = torch.ones((4, 3))
    draws = [lambda: torch_random.normal((2,), seed=seed),
             lambda: torch_random.uniform((2,), seed=seed),
             lambda: torch_random.randint((2,), 0, 5, seed=seed),
             lambda: torch_random.dropout(x, 0.5, noise_shape=(None, 1), seed=seed),
             lambda: torch_random.shuffle(x, seed=seed),
             lambda: torch_random.categorical(torch.zeros((2, 3)), 4, seed=seed)]
    for i, draw in enumerate(draws):
        draw()
        assert len(made) == i + 1, i
    assert tuple(torch_random._get_concrete_noise_shape(x, (None, 1))) == (4, 1)


@relies_on(("keras.src.random.seed_generator", "global_seed_generator"),
           ("keras.src.random.seed_generator", "SeedGenerator._initial_seed"))
def test_unseeded_draws_use_the_global_seed_generator_and_a_seeded_one_keeps_its_seed():
    from keras.src.random import seed_generator

    assert isinstance(seed_generator.global_seed_generator(), keras.random.SeedGenerator)
    assert seed_generator.global_seed_generator() is seed_generator.global_seed_generator()
    assert keras.random.SeedGenerator(7)._initial_seed == 7
    assert keras.layers.Dropout(0.5).seed_generator._initial_seed is None  # unseeded


@relies_on(("keras.src.backend.torch.core", "cond"))
def test_torch_cond_branches_in_python_on_the_predicate():
    """cond_fixes swaps it: Keras's torch cond is a Python if on the predicate (a host
    read of a tensor): only the taken branch runs."""
    from keras.src.backend.torch import core

    ran = []
    out = core.cond(torch.tensor(True), lambda: ran.append("t") or torch.tensor(1.0),
                    lambda: ran.append("f") or torch.tensor(2.0))
    assert float(out) == 1.0 and ran == ["t"]


@relies_on(("keras.src.backend.torch.core", "convert_to_tensor"))
def test_convert_to_tensor_makes_python_scalars_and_lists_tensors_on_the_device():
    from keras.src.backend.torch import core

    for value in (1.5, [1.0, 2.0], np.float32(3.0)):
        t = core.convert_to_tensor(value)
        assert isinstance(t, torch.Tensor) and t.device.type == core.get_device().split(":")[0]


@relies_on(("keras.src.backend.torch.math", "_segment_reduction_fn"),
           ("keras.src.backend.torch.core", "scatter"),
           ("keras.src.backend.torch.numpy", "max"))
def test_the_metric_helpers_kmgpu_replaces_compute_these_values():
    """kmgpu's replacements must give Keras's values: segment_sum, scatter (adds
    duplicates) and max with initial=."""
    from keras.src.backend.torch import core, math, numpy as tnp

    data = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ids = torch.tensor([0, 0, 2, 2])
    assert math.segment_sum(data, ids, num_segments=3).tolist() == [3.0, 0.0, 7.0]
    assert callable(math._segment_reduction_fn)
    out = core.scatter(torch.tensor([[0], [0], [2]]), torch.tensor([1.0, 2.0, 5.0]), (3,))
    assert out.tolist() == [3.0, 0.0, 5.0]
    assert tnp.max(torch.tensor([[1.0, -2.0]]), axis=1, initial=0.5).tolist() == [1.0]
    assert tnp.max(torch.tensor([[-1.0, -2.0]]), axis=1, initial=0.5).tolist() == [0.5]


@relies_on(("keras.src.layers.rnn.rnn", "RNN.call"))
def test_a_stateful_rnn_assigns_its_states_after_its_call():
    """copy_states_in wraps RNN.call on stateful layers: Keras's call assigns the new
    states to the state variables when it returns."""
    layer = keras.layers.GRU(2, stateful=True)
    x = np.ones((3, 4, 2), "float32")
    layer(x)
    before = keras.ops.convert_to_numpy(layer.states[0]).copy()
    layer(x)
    after = keras.ops.convert_to_numpy(layer.states[0])
    assert before.shape == (3, 2) and not np.allclose(before, after)


@relies_on(("keras.src.backend.torch.trainer", "TorchEpochIterator"),
           ("keras.src.trainers.epoch_iterator", "EpochIterator._enumerate_iterator"))
def test_the_epoch_iterator_reads_batches_in_order_and_enumerating_reads_none():
    """data_fixes reads data epoch by epoch as Keras's torch fit does (TorchEpochIterator:
    (begin, end, [batch]) per step) and enumerates a validation pass alone
    (_enumerate_iterator: the steps, without fetching a batch)."""
    from keras.src.backend.torch.trainer import TorchEpochIterator

    x, y = tiny_xy(10)
    it = TorchEpochIterator(x=x, y=y, batch_size=4, shuffle=False)
    batches = [data for _, _, data in it]
    assert [len(b[0][0]) for b in batches] == [4, 4, 2]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(batches[0][0][0]), x[:4])
    fetched = []
    it = TorchEpochIterator(x=x, y=y, batch_size=4, shuffle=False)
    original = it._get_iterator
    it._get_iterator = lambda: (fetched.append(1), original())[1]
    assert [step for step, _, _ in it._enumerate_iterator()] == [0, 1, 2]
    assert fetched  # the iterator is made, no batch read


# -- faster kernels on CUDA (fast_fixes): what Keras's own computes ------------------------
@relies_on(("keras.src.layers.rnn.gru", "GRU.inner_loop"),
           ("keras.src.layers.rnn.lstm", "LSTM.inner_loop"))
def test_kerass_torch_gru_and_lstm_kernels_refuse_any_mask():
    """fast_rnn swaps inner_loop (what RNN.call runs) because Keras's torch gru() and
    lstm() raise NotImplementedError for any mask, so a masked layer runs the generic
    per-timestep loop."""
    import importlib

    import pytest

    rnn = importlib.import_module("keras.src.backend.torch.rnn")  # the package's rnn is a function

    x, mask = torch.ones((2, 3, 4)), torch.ones((2, 3), dtype=torch.bool)
    with pytest.raises(NotImplementedError):
        rnn.gru(x, torch.zeros((2, 5)), mask, None, None, None, None, None)
    with pytest.raises(NotImplementedError):
        rnn.lstm(x, torch.zeros((2, 5)), torch.zeros((2, 5)), mask, None, None, None, None,
                 None)
    for layer in (keras.layers.GRU(5), keras.layers.LSTM(5)):
        calls = []
        keras_fixes.install(layer, "inner_loop", lambda original: lambda *a, **k: (
            calls.append(1), original(*a, **k))[1])
        out = layer(x, mask=mask)
        assert calls and tuple(out.shape) == (2, 5)


@relies_on(("keras.src.layers.core.dense", "Dense.call"))
def test_dense_is_matmul_plus_bias_then_activation():
    """fast_fixes' dense_call (F.linear, then the activation) must equal Keras's call."""
    layer = keras.layers.Dense(3, activation="relu")
    x = torch.randn(4, 2)
    layer.build((4, 2))
    want = torch.relu(x @ layer.kernel.value + layer.bias.value)
    torch.testing.assert_close(layer(x), want)


@relies_on(("keras.src.layers.core.einsum_dense", "EinsumDense.call"))
def test_einsum_dense_is_einsum_plus_bias_then_activation():
    """fast_einsum.call (F.linear over 2-D views, then the activation) must equal Keras's
    call: the einsum of the equation, the bias added over the output axes it names."""
    layer = keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de",
                                     activation="relu", bias_initializer="uniform")
    x = torch.randn(4, 5, 2)
    layer.build(x.shape)
    want = torch.relu(torch.einsum("abc,cde->abde", x, layer.kernel.value) + layer.bias.value)
    torch.testing.assert_close(layer(x), want)


@relies_on(("keras.src.backend.torch.nn", "_transpose_spatial_inputs"))
def test_channels_last_inputs_are_permuted_to_channels_first():
    """fast_conv returns the permuted view where Keras makes a contiguous copy: the same
    values and shape."""
    from keras.src.backend.torch import nn

    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    out = nn._transpose_spatial_inputs(x)
    assert tuple(out.shape) == (2, 5, 3, 4)
    torch.testing.assert_close(out, x.permute(0, 3, 1, 2))


@relies_on(("keras.src.backend.torch.nn", "sparse_categorical_crossentropy"))
def test_sparse_categorical_crossentropy_is_the_negative_log_likelihood():
    from keras.src.backend.torch import nn

    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
    target = torch.tensor([0, 2])
    want = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(nn.sparse_categorical_crossentropy(target, logits,
                                                                  from_logits=True), want)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(nn.sparse_categorical_crossentropy(target, probs), want,
                               rtol=1e-5, atol=1e-5)


@relies_on(("keras.src.layers.normalization.batch_normalization", "BatchNormalization.call"))
def test_batchnorm_in_training_is_the_textbook_formula():
    """fused_batchnorm (torch's fused kernel) must equal Keras's call: the batch's mean
    and biased variance normalize, the moving statistics move by momentum."""
    layer = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3)
    x = torch.randn(16, 3)
    layer.build((16, 3))
    layer.gamma.assign(np.array([1.0, 2.0, 0.5], "float32"))
    layer.beta.assign(np.array([0.1, -0.2, 0.3], "float32"))
    out = layer(x, training=True)
    mean, var = x.mean(0), x.var(0, unbiased=False)
    want = (x - mean) / torch.sqrt(var + 1e-3) * layer.gamma.value + layer.beta.value
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.moving_mean.value, 0.1 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.moving_variance.value, 0.9 + 0.1 * var,
                               rtol=1e-5, atol=1e-6)


@relies_on(("keras.src.layers.preprocessing.image_preprocessing.random_crop",
            "RandomCrop.transform_images"))
def test_a_training_random_crop_is_a_window_of_the_image():
    """device_random swaps transform_images(images, transformation, training): in training
    it returns a height x width window of each image."""
    layer = keras.layers.RandomCrop(2, 3, seed=1)
    images = torch.arange(5 * 6, dtype=torch.float32).reshape(1, 5, 6, 1)
    transformation = layer.get_random_transformation(images, training=True)
    out = layer.transform_images(images, transformation, training=True)
    assert tuple(out.shape) == (1, 2, 3, 1)
    windows = [images[:, i:i + 2, j:j + 3] for i in range(4) for j in range(4)]
    assert any(torch.equal(out.cpu(), w) for w in windows)


@relies_on(("keras.src.trainers.trainer", "Trainer.get_metrics_result"))
def test_a_replica_reads_its_metrics_as_the_base_trainer_does():
    """read_logs_within gives each replica Trainer.get_metrics_result where the torch
    trainer overrides it (Keras master all-reduces there): the metrics' results read
    from the variables, with no collective."""
    from contextlib import nullcontext

    from keras.src.backend.torch.trainer import TorchTrainer
    from keras.src.trainers.trainer import Trainer

    model = tiny_mlp(metrics=["mae"])
    x, y = tiny_xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    want = {k: float(v) for k, v in Trainer.get_metrics_result(model).items()}
    assert set(want) == {"loss", "mae"}
    step_fixes.read_logs_within(model, lambda: nullcontext(False))
    got = model.get_metrics_result()
    assert {k: float(v) for k, v in got.items()} == want
    if TorchTrainer.get_metrics_result is not Trainer.get_metrics_result:  # Keras master
        assert model.get_metrics_result.__func__ is Trainer.get_metrics_result


@relies_on(("keras.src.backend.common.masking", "get_keras_mask"),
           ("keras.src.backend.common.masking", "set_keras_mask"))
def test_a_masked_output_carries_its_mask_and_detached_keeps_it():
    """A masked metric reads the mask on the output tensor: without it the padded
    timesteps count (the metric moves), with ``detached``'s copy it is as before."""
    inputs = keras.Input((3, 1))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Masking(0.0)(inputs)))
    x = np.array([[[1.0], [2.0], [0.0]]], "float32")
    y = model(x)
    metric = keras.metrics.MeanAbsoluteError()
    metric.update_state(np.zeros((1, 3, 1), "float32"), step_fixes.detached(y))
    masked = float(metric.result())
    metric.reset_state()
    metric.update_state(np.zeros((1, 3, 1), "float32"), y.detach())  # no mask on it
    assert masked != float(metric.result())
    expected = float(np.abs(keras.ops.convert_to_numpy(y)[0, :2]).mean())
    np.testing.assert_allclose(masked, expected, rtol=1e-6)


@relies_on(("keras.src.backend.common.variables", "Variable._initialize_with_initializer"))
def test_weights_and_optimizer_slots_are_made_through_initialize_with_initializer():
    """A layer's weights and an optimizer's slots are made from their initializers there,
    and ``_initialize`` keeps the tensor it is given as the Parameter (its memory, not a
    copy): made there without memory, they hold none, and get it back when grown."""
    from kmgpu.engines.torch import layer_fixes

    def floats(v):
        return len(v.shape) > 0 and "float" in str(v.dtype)

    with layer_fixes.unfilled_variables(floats):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
        opt = keras.optimizers.Adam()
        opt.build(model.trainable_weights)
    made = list(model.weights) + [v for v in opt.variables if floats(v)]
    assert len(made) == 6 and all(v.value.untyped_storage().nbytes() == 0 for v in made)
    assert int(opt.iterations.numpy()) == 0  # not picked: made from its initializer
    kernel = model.weights[0]
    kernel.value.untyped_storage().resize_(4 * 3 * 4)
    kernel.assign(np.ones((3, 4), "float32"))
    np.testing.assert_array_equal(kernel.numpy(), np.ones((3, 4)))
    assert keras.layers.Dense(2).add_weight(shape=(2,)).value.untyped_storage().nbytes() == 8


@relies_on(("keras.src.backend.torch.core", "Variable.value"),
           ("keras.src.backend.torch.core", "Variable._direct_assign"))
def test_a_variable_is_read_through_value_and_assigned_through_direct_assign():
    """kmgpu's held optimizer slots (optim.held) fetch on the first read of ``value`` and
    let go on ``_direct_assign``: numpy(), np.asarray, an op and Keras's optimizer update
    read through the property, and assign goes through the method."""
    from kmgpu.engines.torch.optim import held

    v = keras.Variable(np.ones((2, 2), "float32"))
    fetched = []

    def fetch():
        fetched.append(1)
        held.let_go(v)
        v.assign(np.full((2, 2), 3.0, "float32"))

    for read in (lambda: v.numpy(), lambda: np.asarray(v), lambda: keras.ops.add(v, 1.0),
                 lambda: keras.optimizers.SGD(1.0).apply([keras.ops.ones((2, 2))], [v])):
        held.hold([v], fetch)
        assert held.raw(v) is v._value and len(fetched) == 0
        read()
        assert fetched == [1] and not held.held(v)
        fetched.clear()
    held.hold([v], fetch)
    v.assign(np.zeros((2, 2), "float32"))
    assert not fetched and not held.held(v) and float(v.numpy().sum()) == 0.0

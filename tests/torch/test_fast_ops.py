"""Dense through F.linear and the sparse cross-entropy over a contiguous (rows, classes) view
(engines/torch/fast/layers.py, swapped in by fast_fixes.fast_ops inside kmgpu's steps
on CUDA) against Keras's own: loss values and gradients, masks, sample weights,
ignore_class, what each leaves to Keras's code, and a 2-epoch fit through kmgpu's split
step (made to swap on a CPU here) against plain Keras. Tiny tensors on a CPU."""

import keras
import numpy as np
import pytest
import torch
from keras.src.backend.torch import nn as keras_nn  # the module whose function is swapped

from kmgpu.engines.torch import fast_fixes
from kmgpu.engines.torch.fast import layers as fast_layers
from tests.helpers import rel_diff
from tests.torch.fast_paths import fit, rel

TOL = 1e-6
SCCE = keras.losses.SparseCategoricalCrossentropy


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that take fast_layers' path (not its fallback)."""
    taken = {"loss": 0, "dense": 0}
    loss, dense = fast_layers.sparse_categorical_crossentropy, fast_layers.dense_call

    def counted_loss(target, output, from_logits=False, axis=-1, *, fallback):
        taken["loss"] += fast_layers.sparse_ce_why_not(target, output, from_logits, axis) is None
        return loss(target, output, from_logits, axis, fallback=fallback)

    def counted_dense(layer, inputs, training=None, *, fallback):
        taken["dense"] += fast_layers.dense_why_not(layer, inputs) is None
        return dense(layer, inputs, training, fallback=fallback)

    monkeypatch.setattr(fast_layers, "sparse_categorical_crossentropy", counted_loss)
    monkeypatch.setattr(fast_layers, "dense_call", counted_dense)
    monkeypatch.setattr(fast_fixes, "on_cuda", lambda device: True)
    for name in fast_layers.SWITCHES.values():
        monkeypatch.delenv(name, raising=False)
    return taken


def _loss_and_grad(loss, y, logits, **kw):
    logits = logits.clone().requires_grad_(True)
    value = loss(y, logits, **kw)
    return value, torch.autograd.grad(value, logits)[0]


@pytest.mark.parametrize("case", ["plain", "sample_weight", "mask", "ignore_class",
                                  "label_axis", "probabilities", "class_axis_1", "rank_2"])
def test_sparse_ce_equals_kerass(spy, case):
    """Keras's loss object inside the swap against outside it: value and gradient; the fast
    path for logits with the class axis last at rank >= 3, Keras's code otherwise."""
    rng = np.random.default_rng(0)
    shape, axis, kw, loss_kw = (3, 5, 11), -1, {}, {"from_logits": True}
    y = torch.as_tensor(rng.integers(0, 11, shape[:-1]))
    if case == "sample_weight":
        kw["sample_weight"] = torch.as_tensor(rng.uniform(0, 2, shape[:-1]), dtype=torch.float32)
    elif case == "ignore_class":
        loss_kw["ignore_class"] = 2
        y = torch.where(y % 3 == 0, 2, y)
    elif case == "label_axis":
        y = y[..., None]
    elif case == "probabilities":
        loss_kw["from_logits"] = False
    elif case == "class_axis_1":
        shape, axis = (3, 11, 5), 1
        y = torch.as_tensor(rng.integers(0, 11, (3, 5)))
    elif case == "rank_2":
        shape = (6, 11)
        y = torch.as_tensor(rng.integers(0, 11, (6,)))
    logits = torch.as_tensor(rng.standard_normal(shape) * 3, dtype=torch.float32)
    if case == "probabilities":
        logits = torch.softmax(logits, -1)
    if case == "mask":
        keras.src.backend.set_keras_mask(logits, torch.as_tensor(rng.uniform(size=(3, 5)) > 0.3))
    loss = SCCE(axis=axis, **loss_kw)
    ref = _loss_and_grad(loss, y, logits, **kw)
    with fast_fixes.fast_ops("cuda:0"):
        assert keras_nn.sparse_categorical_crossentropy.__wrapped_by_kmgpu__ is not None
        fast = _loss_and_grad(loss, y, logits, **kw)
    assert not hasattr(keras_nn.sparse_categorical_crossentropy, "__wrapped_by_kmgpu__")
    fast_path = case not in ("probabilities", "class_axis_1", "rank_2")
    assert spy["loss"] == int(fast_path), case
    assert rel(ref[0], fast[0]) <= TOL and rel(ref[1], fast[1]) <= TOL
    assert float(ref[0].detach()) > 0.1


@pytest.mark.parametrize("case", ["gelu", "linear_2d", "mixed_bfloat16", "no_bias", "int"])
def test_dense_equals_kerass(spy, case):
    """Dense's output and the gradients of inputs, kernel and bias inside the swap against
    Keras's own call; a layer without a bias, or integer inputs, keeps Keras's call."""
    keras.utils.set_random_seed(1)
    shape = (6, 4) if case == "linear_2d" else (3, 5, 4)
    layer = keras.layers.Dense(
        7, activation=None if case == "linear_2d" else "gelu", use_bias=case != "no_bias",
        dtype="mixed_bfloat16" if case == "mixed_bfloat16" else None,
        bias_initializer="uniform")
    layer.build(shape)
    x = torch.as_tensor(np.random.default_rng(2).standard_normal(shape) * 2, dtype=torch.float32)
    if case == "int":
        x = (x * 3).to(torch.int32)

    def run():
        inp = x.clone().requires_grad_(x.is_floating_point())
        out = layer(inp)
        params = [w.value for w in layer.trainable_weights]
        grads = torch.autograd.grad(out.float().square().sum(),
                                    ([inp] if x.is_floating_point() else []) + params)
        return [out] + list(grads)

    ref = run()
    with fast_fixes.fast_ops("cuda:0"):
        fast = run()
    assert spy["dense"] == int(case in ("gelu", "linear_2d", "mixed_bfloat16")), case
    tol = 1e-2 if case == "mixed_bfloat16" else TOL  # bfloat16: one rounding more or less
    for a, b in zip(ref, fast):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a.float(), b.float()) <= tol


def _lm(vocab=13, seq=6):
    keras.utils.set_random_seed(4)
    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, 8, mask_zero=True)(tokens)
    h = L.Dense(16, activation="gelu")(h)
    return keras.Model(tokens, L.Dense(vocab)(h))


@pytest.fixture(scope="module")
def lm_data():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 13, (40, 6)).astype("int32")
    return x, np.roll(x, -1, axis=1), rng.uniform(0.5, 1.5, (40, 6)).astype("float32")


def _fit(lm_data, parallel):
    x, y, sw = lm_data
    model = _lm()
    return model, fit(model, x, y, parallel, SCCE(from_logits=True, ignore_class=3),
                      sample_weight=sw)


def test_fit_through_kmgpus_step_equals_plain_keras(spy, lm_data):
    """A tiny masked language model (Embedding(mask_zero) -> Dense(gelu) -> Dense(vocab);
    the loss with ignore_class and sample weights), 2 epochs: kmgpu's split step with both
    swaps in (every step took both fast paths) against plain Keras: weights and losses."""
    ref, ref_loss = _fit(lm_data, False)
    assert spy == {"loss": 0, "dense": 0}
    model, loss = _fit(lm_data, True)
    assert spy["loss"] >= 10 and spy["dense"] >= 20, spy
    assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5
    assert np.allclose(ref_loss, loss, rtol=1e-5, atol=0)


def test_switches_and_describe(spy, monkeypatch):
    """KMGPU_TORCH_FAST_LOSS=0 / KMGPU_TORCH_FAST_DENSE=0 keep Keras's own inside the
    block; Keras's functions are back after it; describe() names the path on a GPU only."""
    keras_loss, keras_call = keras_nn.sparse_categorical_crossentropy, keras.layers.Dense.call
    model = _lm()
    model.compile(loss=SCCE(from_logits=True))
    assert "F.linear" in fast_layers.describe_ops(model, on_gpu=True)
    assert "contiguous (rows, classes)" in fast_layers.describe_ops(model, on_gpu=True)
    assert fast_layers.describe_ops(model, on_gpu=False) == ""
    monkeypatch.setenv("KMGPU_TORCH_FAST_LOSS", "0")
    with fast_fixes.fast_ops("cuda:0"):
        assert keras_nn.sparse_categorical_crossentropy is keras_loss
        assert keras.layers.Dense.call.__wrapped_by_kmgpu__ is keras_call
    monkeypatch.setenv("KMGPU_TORCH_FAST_DENSE", "0")
    with fast_fixes.fast_ops("cuda:0"):
        assert keras.layers.Dense.call is keras_call
    assert "Keras's own (KMGPU_TORCH_FAST_LOSS=0)" in fast_layers.describe_ops(model, True)
    monkeypatch.setattr(fast_fixes, "on_cuda", lambda device: False)
    monkeypatch.delenv("KMGPU_TORCH_FAST_LOSS")
    with fast_fixes.fast_ops("cpu"):
        assert keras_nn.sparse_categorical_crossentropy is keras_loss
    assert keras.layers.Dense.call is keras_call

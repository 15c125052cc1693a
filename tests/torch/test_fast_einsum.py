"""EinsumDense through F.linear (engines/torch/fast/einsum.py, swapped in by
fast_fixes.fast_ops inside kmgpu's steps on CUDA) against Keras's own call: which equations
take the path, outputs and the gradients of inputs, kernel and bias (LoRA included), and a
2-epoch fit of a tiny attention model through kmgpu's split step (made to swap on a CPU
here) against plain Keras. Tiny tensors on a CPU."""

import keras
import numpy as np
import pytest
import torch

from kmgpu.engines.torch import fast_fixes
from kmgpu.engines.torch.fast import einsum as fast_einsum, layers as fast_layers
from tests.helpers import rel_diff
from tests.torch.fast_paths import fit, rel

TOL = 1e-6


@pytest.fixture
def spy(monkeypatch):
    """Counts the EinsumDense calls that take the fast path (not Keras's call)."""
    taken = []
    call = fast_einsum.call

    def counted(layer, inputs, training=None, *, fallback):
        taken.append(fast_einsum.why_not(layer, inputs))
        return call(layer, inputs, training, fallback=fallback)

    monkeypatch.setattr(fast_einsum, "call", counted)
    monkeypatch.setattr(fast_fixes, "on_cuda", lambda device: True)
    for name in fast_layers.SWITCHES.values():
        monkeypatch.delenv(name, raising=False)
    return taken


def test_which_equations_are_a_dense():
    plan = fast_einsum.plan
    assert plan("abc,cde->abde", "de") == (2, 2, None)      # attention's query/key/value
    assert plan("abcd,cde->abe", "e") == (2, 1, None)       # attention's output
    assert plan("btd,ndh->btnh", "nh") == (2, 2, (1, 0, 2))  # kernel axes permuted
    assert plan("ab,bc->ac", "c") == (1, 1, None)
    assert plan("btd,de->bte", "te") == "a bias over other axes than the kernel's output axes"
    assert plan("abc,cde->abde", "e") == "a bias over other axes than the kernel's output axes"
    assert plan("...b,bc->...c", "c") == "an equation with an ellipsis or other than two operands"
    assert plan("abc,acd->abd", "d") == "not a product over the inputs' trailing axes"
    assert plan("abc,cd->abdc", "d") == "not a product over the inputs' trailing axes"


CASES = {  # name: (equation, output_shape, bias_axes, input shape, activation, lora)
    "query": ("abc,cde->abde", (5, 2, 3), "de", (3, 5, 4), None, False),
    "output": ("abcd,cde->abe", (5, 4), "e", (3, 5, 2, 3), None, False),
    "permuted": ("btd,ndh->btnh", (5, 2, 3), "nh", (3, 5, 4), "gelu", False),
    "lora": ("abc,cde->abde", (5, 2, 3), "de", (3, 5, 4), None, True),
    "position": ("btd,de->bte", (5, 4), "te", (3, 5, 4), None, False),
    "no_bias": ("abc,cde->abde", (5, 2, 3), None, (3, 5, 4), None, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_einsum_dense_equals_kerass(spy, case):
    """Output and the gradients of inputs and every trainable weight inside the swap
    against Keras's own call; the fast path only where ``plan`` allows and a bias exists."""
    equation, out, bias_axes, shape, activation, lora = CASES[case]
    keras.utils.set_random_seed(1)
    layer = keras.layers.EinsumDense(equation, out, bias_axes=bias_axes, activation=activation,
                                     bias_initializer="uniform")
    layer.build(shape)
    if lora:
        layer.enable_lora(2, b_initializer="uniform")
    x = torch.as_tensor(np.random.default_rng(2).standard_normal(shape) * 2,
                        dtype=torch.float32)

    def run():
        inp = x.clone().requires_grad_(True)
        y = layer(inp)
        params = [w.value for w in layer.trainable_weights]
        return [y] + list(torch.autograd.grad(y.square().sum(), [inp] + params))

    ref = run()
    with fast_fixes.fast_ops("cuda:0"):
        fast = run()
    assert [why is None for why in spy] == [case in ("query", "output", "permuted", "lora")]
    assert len(ref) == len(fast) == 2 + len(layer.trainable_weights)
    for a, b in zip(ref, fast):
        assert a.shape == b.shape and rel(a, b) <= TOL
    assert float(ref[0].detach().abs().max()) > 0.1


def _attention(seq=6, d=8):
    keras.utils.set_random_seed(4)
    L = keras.layers
    x = keras.Input((seq, d))
    h = L.MultiHeadAttention(2, key_dim=4)(x, x, use_causal_mask=True)
    h = L.LayerNormalization()(h + x)
    return keras.Model(x, L.Dense(1)(h))


def test_attention_fit_through_kmgpus_step_equals_plain_keras(spy):
    """A tiny causal self-attention model, 2 epochs: kmgpu's split step with the swap in
    (every projection of every step took the fast path) against plain Keras: weights and
    losses."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 6, 8)).astype("float32")
    y = rng.standard_normal((40, 6, 1)).astype("float32")
    ref = _attention()
    ref_loss = fit(ref, x, y, False, "mse")
    assert spy == []
    model = _attention()
    loss = fit(model, x, y, True, "mse")
    assert len(spy) >= 4 * 10 and all(why is None for why in spy), spy[:4]
    # the key's bias adds the same score to every key of a query, which softmax removes:
    # its gradient is zero up to rounding, and Adam moves it by noise on either path
    noise = [w.path.endswith("key/bias") for w in ref.weights]
    assert sum(noise) == 1
    kept = [(a, b) for a, b, n in zip(ref.get_weights(), model.get_weights(), noise) if not n]
    assert rel_diff(*zip(*kept)) <= 1e-5
    key_bias = [(a, b) for a, b, n in zip(ref.get_weights(), model.get_weights(), noise) if n]
    assert all(np.abs(w).max() < 1e-2 for w in key_bias[0])
    assert np.allclose(ref_loss, loss, rtol=1e-5, atol=0)


def test_switch_and_describe(spy, monkeypatch):
    """KMGPU_TORCH_FAST_EINSUM=0 keeps Keras's own call inside the block; describe() names
    the path on a GPU only, and the switch."""
    keras_call = keras.layers.EinsumDense.call
    model = _attention()
    words = fast_layers.describe_ops(model, on_gpu=True)
    assert "; EinsumDense through F.linear" in words and "KMGPU_TORCH_FAST_EINSUM=0" in words
    assert fast_layers.describe_ops(model, on_gpu=False) == ""
    with fast_fixes.fast_ops("cuda:0"):
        assert keras.layers.EinsumDense.call.__wrapped_by_kmgpu__ is keras_call
    monkeypatch.setenv("KMGPU_TORCH_FAST_EINSUM", "0")
    with fast_fixes.fast_ops("cuda:0"):
        assert keras.layers.EinsumDense.call is keras_call
    assert "; EinsumDense: Keras's own call (KMGPU_TORCH_FAST_EINSUM=0)" in \
        fast_layers.describe_ops(model, True)
    assert keras.layers.EinsumDense.call is keras_call

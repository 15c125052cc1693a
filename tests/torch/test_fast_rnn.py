"""A masked GRU/LSTM on torch's fused RNN kernel over the compacted sequence
(engines/torch/fast/rnn.py, swapped in by fast_fixes.fast_ops inside kmgpu's steps on
CUDA, forced on a CPU here, where torch's own GRU/LSTM kernel has cuDNN's equations)
against Keras's own masked loop: outputs, final states and gradients for every kind of
mask, go_backwards, return_sequences, zero_output_for_mask, Bidirectional over
Embedding(mask_zero=True), what it leaves to Keras, and a 2-epoch fit through kmgpu's split
step against plain Keras. Tiny tensors on a CPU."""

import keras
import numpy as np
import pytest
import torch

from kmgpu.engines.torch import fast_fixes
from kmgpu.engines.torch.fast import layers as fast_layers, rnn as fast_rnn
from tests.helpers import rel_diff
from tests.torch.fast_paths import fit, rel

TOL = 1e-6
B, T, F, U = 6, 7, 3, 4
MASKS = {  # row patterns: the generic loop's cases
    "right_padded": [[1] * 5 + [0] * 2, [1] * 7, [1] * 2 + [0] * 5],
    "left_padded": [[0] * 3 + [1] * 4, [0] * 6 + [1], [1] * 7],
    "holes": [[1, 0, 0, 1, 0, 1, 1], [0, 1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 1, 0]],
    "fully_masked_row": [[0] * 7, [1] * 4 + [0] * 3, [0, 1, 0, 1, 0, 1, 0]],
    "one_valid_step": [[0, 0, 0, 1, 0, 0, 0], [1] + [0] * 6, [0] * 6 + [1]],
}
MIXED = [row for rows in MASKS.values() for row in rows][::2][:B]


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that take fast_rnn's path (not Keras's loop)."""
    taken = []
    real = fast_rnn.masked_rnn

    def counted(kind, *args, **kw):
        taken.append(kind)
        return real(kind, *args, **kw)

    monkeypatch.setattr(fast_rnn, "masked_rnn", counted)
    monkeypatch.setattr(fast_fixes, "on_cuda", lambda device: True)
    for name in fast_layers.SWITCHES.values():
        monkeypatch.delenv(name, raising=False)
    return taken


def _run(layer, x, mask, initial_state=None, training=None):
    """The layer's outputs (and states) and the gradients of inputs and weights of a
    weighted sum of them all."""
    inp = x.clone().requires_grad_(True)
    kw = {"initial_state": initial_state} if initial_state is not None else {}
    out = layer(inp, mask=mask, training=training, **kw)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    loss = sum((o * torch.linspace(-1, 2, o.numel()).reshape(o.shape)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [inp] + [w.value for w in layer.trainable_weights])
    return outs + list(grads)


def _compare(make, rows, initial=False, training=None, expect=1):
    keras.utils.set_random_seed(1)
    layer = make()
    layer.build((len(rows), T, F))
    rng = np.random.default_rng(2)
    x = torch.as_tensor(rng.standard_normal((len(rows), T, F)), dtype=torch.float32)
    mask = torch.as_tensor(np.array(rows, bool))
    h0 = None
    if initial:
        h0 = torch.as_tensor(rng.standard_normal((len(rows), U)), dtype=torch.float32)
    keras.utils.set_random_seed(3)
    ref = _run(layer, x, mask, h0, training)
    keras.utils.set_random_seed(3)
    with fast_fixes.fast_ops("cuda:0"):
        fast = _run(layer, x, mask, h0, training)
    assert len(ref) == len(fast)
    for a, b in zip(ref, fast):
        assert a.shape == b.shape and rel(a, b) <= TOL, (a, b)
    return ref


@pytest.mark.parametrize("case", sorted(MASKS))
def test_gru_equals_kerass_loop_for_each_mask(spy, case):
    """GRU(return_sequences, return_state) from a given initial state: outputs, final state,
    gradients of inputs, kernel, recurrent kernel and bias, for each kind of mask."""
    ref = _compare(lambda: keras.layers.GRU(U, return_sequences=True, return_state=True,
                                            bias_initializer="uniform"),
                   MASKS[case], initial=True)
    assert spy == ["gru"]
    if case == "fully_masked_row":  # Keras's loop: zeros out, the initial state kept
        assert float(ref[0][0].detach().abs().max()) == 0.0
        assert float(ref[1][0].detach().abs().max()) > 0.1


@pytest.mark.parametrize("backwards", [False, True], ids=["forwards", "go_backwards"])
@pytest.mark.parametrize("sequences", [False, True], ids=["last", "sequences"])
@pytest.mark.parametrize("zero", [False, True], ids=["prev_output", "zero_output"])
def test_gru_flags(spy, backwards, sequences, zero):
    """go_backwards, return_sequences and zero_output_for_mask, every combination, over a
    mask with every kind of row."""
    _compare(lambda: keras.layers.GRU(U, return_sequences=sequences, return_state=True,
                                      go_backwards=backwards, zero_output_for_mask=zero,
                                      bias_initializer="uniform"), MIXED, initial=True)
    assert spy == ["gru"]


@pytest.mark.parametrize("backwards", [False, True], ids=["forwards", "go_backwards"])
@pytest.mark.parametrize("sequences", [False, True], ids=["last", "sequences"])
def test_lstm_without_final_states(spy, backwards, sequences):
    """An LSTM whose final states the layer discards (no return_state, not stateful)."""
    _compare(lambda: keras.layers.LSTM(U, return_sequences=sequences, go_backwards=backwards,
                                       zero_output_for_mask=sequences,
                                       bias_initializer="uniform"), MIXED)
    assert spy == ["lstm"]


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_weights_reach_the_kernel_as_views_of_one_buffer(spy, monkeypatch, kind):
    """Where cuDNN gives a layout (forced here: out of order, with gaps), the kernel gets
    the weights as views of one buffer at those offsets, so cuDNN neither copies them
    nor warns, and outputs and gradients still equal Keras's loop."""
    real_vf = getattr(torch._VF, kind)
    handed = []

    def layout(kind_, params):
        sizes = [p.numel() for p in params]
        order, offsets, at = [1, 0, 3, 2], [0] * 4, 5
        for i in order:
            offsets[i], at = at, at + sizes[i] + 3
        return offsets, at + 2

    def vf(inputs, states, params, *args):
        handed.append(params)
        return real_vf(inputs, states, params, *args)

    monkeypatch.setattr(fast_rnn, "cudnn_layout", layout)
    monkeypatch.setattr(torch._VF, kind, vf)
    make = keras.layers.GRU if kind == "gru" else keras.layers.LSTM
    _compare(lambda: make(U, return_sequences=True, bias_initializer="uniform"), MIXED)
    assert spy == [kind] and len(handed) == 1
    params = handed[0]
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params)
    got = [(p.data_ptr() - base) // p.element_size() for p in params]
    assert got == layout(kind, params)[0]


def test_gru_input_dropout_while_training(spy):
    """dropout=0.3 in training: the same input dropout mask as Keras's cell applies."""
    ref = _compare(lambda: keras.layers.GRU(U, dropout=0.3, return_sequences=True),
                   MIXED, training=True)
    masked = (1 - np.array(MIXED)).sum() * F  # the gradient is zero there without dropout
    assert spy == ["gru"] and int((ref[1] == 0).sum()) > masked  # some inputs dropped


def test_stateful_gru_carries_the_state_of_the_last_valid_step(spy):
    """A stateful GRU called twice: the second call starts from the first's final state
    (each row's state after its last valid step, Keras's loop's), outputs and states equal."""
    keras.utils.set_random_seed(1)
    layer = keras.layers.GRU(U, stateful=True, return_sequences=True, bias_initializer="uniform")
    layer.build((B, T, F))
    x = torch.as_tensor(np.random.default_rng(2).standard_normal((2, B, T, F)), dtype=torch.float32)
    mask = torch.as_tensor(np.array(MIXED, bool))

    def run():
        layer.reset_states()
        with torch.no_grad():
            outs = [layer(x[i], mask=mask) for i in range(2)]
        return outs + [layer.states[0].value.clone()]

    ref = _same_inside_and_outside(run, spy, ["gru", "gru"])
    assert float(ref[-1].abs().max()) > 0.1


@pytest.mark.parametrize("case", ["no_mask", "lstm_return_state", "reset_after_false",
                                  "use_cudnn_false", "relu", "recurrent_dropout",
                                  "mixed_bfloat16"])
def test_what_stays_with_kerass_code(spy, case):
    """Each case runs Keras's own code inside the swap (the spy sees nothing), with its
    results; fast_rnn.why_not names it."""
    kw = {"bias_initializer": "uniform"}
    if case == "lstm_return_state":
        make = lambda: keras.layers.LSTM(U, return_state=True, **kw)  # noqa: E731
    else:
        kw.update({"reset_after_false": {"reset_after": False}, "use_cudnn_false":
                   {"use_cudnn": False}, "relu": {"activation": "relu"},
                   "recurrent_dropout": {"recurrent_dropout": 0.5},
                   "mixed_bfloat16": {"dtype": "mixed_bfloat16"}}.get(case, {}))
        make = lambda: keras.layers.GRU(U, **kw)  # noqa: E731
    keras.utils.set_random_seed(1)
    layer = make()
    layer.build((3, T, F))
    x = torch.ones((3, T, F))
    mask = None if case == "no_mask" else torch.as_tensor(np.array(MASKS["holes"], bool))
    seen = x.to(getattr(torch, layer.compute_dtype))  # what the layer passes inner_loop
    assert fast_rnn.why_not(layer, seen, mask, "lstm" if "lstm" in case else "gru")
    with fast_fixes.fast_ops("cuda:0"):
        out = layer(x, mask=mask)
    assert spy == []
    assert torch.isfinite(out[0] if isinstance(out, (list, tuple)) else out).all()


def _bidirectional(seed=4, vocab=9, sequences=False):
    keras.utils.set_random_seed(seed)
    L = keras.layers
    tokens = keras.Input((T,), dtype="int32")
    h = L.Embedding(vocab, 5, mask_zero=True)(tokens)
    h = L.Bidirectional(L.GRU(U, return_sequences=sequences))(h)
    return keras.Model(tokens, L.Dense(2)(h))  # with sequences: a class per step


def _tokens(n, seed=5):
    """Token rows padded with zeros on the right, the left, in the middle, or all zeros."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 9, (n, T))
    keep = np.array([MASKS[k][i % 3] for i, k in zip(range(n), sorted(MASKS) * n)], bool)
    return np.where(keep, x, 0).astype("int32")


@pytest.mark.parametrize("sequences", [False, True], ids=["last", "sequences"])
def test_bidirectional_over_embedding_mask_zero(spy, sequences):
    """Bidirectional(GRU) over Embedding(mask_zero=True) (the backward layer goes
    backwards; zero_output_for_mask forced to return_sequences by Bidirectional): the
    model's output and every weight's gradient."""
    model = _bidirectional(sequences=sequences)
    x = torch.as_tensor(_tokens(10))

    def run():
        out = model(x)
        loss = (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
        return [out] + list(torch.autograd.grad(loss, [w.value for w in
                                                       model.trainable_weights]))

    _same_inside_and_outside(run, spy, ["gru", "gru"])


def _same_inside_and_outside(run, spy, taken):
    """``run()``'s tensors outside the swap and inside it equal to ``TOL``, the spy having
    seen ``taken`` inside; returns the ones from outside."""
    ref = run()
    with fast_fixes.fast_ops("cuda:0"):
        fast = run()
    assert spy == taken
    for a, b in zip(ref, fast):
        assert rel(a, b) <= TOL
    return ref


def _fit(parallel):
    x = _tokens(48)
    y = (x % 2).astype("int32")  # a class per step; Keras's loss leaves the masked ones out
    model = _bidirectional(sequences=True)
    losses = fit(model, x, y, parallel,
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, losses


def test_fit_through_kmgpus_step_equals_plain_keras(spy):
    """Bidirectional GRU over Embedding(mask_zero=True), 2 epochs of 6 steps: kmgpu's split
    step with the swap in (every step's forward took the path, both directions) against
    plain Keras: weights and losses."""
    ref, ref_loss = _fit(False)
    assert spy == []
    model, loss = _fit(True)
    assert spy.count("gru") >= 24, spy
    assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5
    assert np.allclose(ref_loss, loss, rtol=1e-5, atol=0)


def test_switch_and_describe(spy, monkeypatch):
    """KMGPU_TORCH_FAST_RNN=0 keeps Keras's inner_loop inside the block; Keras's methods are
    back after it; describe() names the path on a GPU only."""
    keras_gru, keras_lstm = keras.layers.GRU.inner_loop, keras.layers.LSTM.inner_loop
    model = _bidirectional()
    assert "GRU with a mask: cuDNN over the compacted sequence" in \
        fast_layers.describe_ops(model, on_gpu=True)
    assert fast_layers.describe_ops(model, on_gpu=False) == ""
    with fast_fixes.fast_ops("cuda:0"):
        assert keras.layers.GRU.inner_loop.__wrapped_by_kmgpu__ is keras_gru
        assert keras.layers.LSTM.inner_loop.__wrapped_by_kmgpu__ is keras_lstm
    monkeypatch.setenv("KMGPU_TORCH_FAST_RNN", "0")
    with fast_fixes.fast_ops("cuda:0"):
        assert keras.layers.GRU.inner_loop is keras_gru
        model(_tokens(3))
    assert spy == []
    assert "Keras's own loop (KMGPU_TORCH_FAST_RNN=0)" in fast_layers.describe_ops(model, True)
    assert keras.layers.GRU.inner_loop is keras_gru and keras.layers.LSTM.inner_loop is keras_lstm

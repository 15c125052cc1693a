"""shard="gradients" (ZeRO-2) and shard="weights" (ZeRO-3) on torch (engines/torch/optim).

One tiny model carries an Embedding, a BatchNormalization and 103 trainable parameters
(neither 2 nor 4 divides it); 90 rows at batch 8 end in a batch of 2 (at N=4 two ranks
get a stand-in row). Each optimizer case runs once, the (shard value, N) pairs rotating
so that each shard value meets N=2 and N=4; weights, History, the optimizer's variables,
evaluate and predict (one case per shard value) equal one device (plain Keras) to 1e-5
after 2 epochs
(mixed_float16: the unsharded run on as many ranks, float16 sums of 4 and 8 rows differ
at float16 resolution; BatchNorm per replica there, its moving statistics averaged by the
step, else over the global batch). The fits are shared by the tests (module fixture).
shard="weights" under the global mixed_float16 policy, on 2 and 4 ranks: against one
device as the unsharded run on as many ranks is, and equal to that run.
What a rank holds (the meter), each layer's gradient reduce-scattered within the
backward pass, and the layers' gathers however a layer reads its weights:
test_shard_memory.py.
"""

import keras
import numpy as np
import pytest

import kmgpu
from kmgpu.engines.torch.engine import TorchEngine
from tests.helpers import rel_diff
from tests.torch.shard_cases import (BATCH, O, TOL, X, Y, Deferred, batch_grads, opt_state,
                                     tiny)


def _adamw():
    opt = O.AdamW(0.01, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    return opt


CASES = {  # name: (shard, N, optimizer, layer dtype policy)
    "sgd_momentum": ("gradients", 2, lambda: O.SGD(0.02, momentum=0.9), None),
    "adam_schedule": ("weights", 2,
                      lambda: O.Adam(O.schedules.ExponentialDecay(0.02, 5, 0.8)), None),
    "adamw_exclusions": ("gradients", 4, _adamw, None),
    "global_clipnorm": ("weights", 4, lambda: O.SGD(0.05, momentum=0.9, global_clipnorm=0.5),
                        None),
    # float16 layers with the LossScaleOptimizer: its finite check and dynamic scale
    "mixed_float16": ("gradients", 4,
                      lambda: O.LossScaleOptimizer(O.Adam(0.01), dynamic_growth_steps=5),
                      "mixed_float16"),
}
#: the cases whose shard value this engine lays out (the others wait for it)
RUN = [name for name, case in CASES.items() if case[0] in TorchEngine.shards]


#: the cases that evaluate and predict too (one per shard value, on 4 ranks: a stand-in row)
EVALUATED = ("adamw_exclusions", "global_clipnorm")


def _fit(make_opt, dtype, gpus=None, shard=None, evaluated=True):
    model = tiny(dtype)
    # BatchNorm's moments over the global batch, as one device; under mixed_float16
    # (against the unsharded run) per replica, so the step averages its moving statistics
    runner = model if gpus is None else kmgpu.parallelize(model, gpus=gpus, shard=shard,
                                                          sync_batchnorm=dtype is None)
    runner.compile(optimizer=make_opt(), loss="mse", metrics=["mae"])
    history = runner.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    if not evaluated:
        return model, history.history, runner, None, None
    scores = runner.evaluate(X, Y, batch_size=12, verbose=0)
    predicted = runner.predict(X, batch_size=12, verbose=0)
    return model, history.history, runner, scores, predicted


HELD = {}  # name: each rank's bytes held after the fit, evaluate and predict


@pytest.fixture(scope="module")
def fits():
    out = {}
    for name in RUN:
        shard, n, make_opt, dtype = CASES[name]
        evaluated = name in EVALUATED
        ref = _fit(make_opt, dtype, n if dtype else None, evaluated=evaluated)
        mine = _fit(make_opt, dtype, n, shard, evaluated)
        HELD[name] = mine[2]._engine.rank_held_bytes()  # before another pool replaces it
        out[name] = (ref, mine)
    yield out
    for ref, mine in out.values():
        for runner in (ref[2], mine[2]):
            if isinstance(runner, kmgpu.ParallelModel):
                runner.close()


@pytest.mark.parametrize("name", RUN)
def test_sharded_equals_one_device(fits, name):
    """(mixed_float16: its first steps overflow at the initial loss scale and are
    skipped, as Keras does.)"""
    (ref, ref_history, _, ref_eval, ref_pred), (model, history, parallel, ev, pred) = fits[name]
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(opt_state(ref), opt_state(model)) <= TOL  # the whole state, gathered back
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    for key in ref_history:
        np.testing.assert_allclose(ref_history[key], history[key], rtol=TOL, err_msg=key)
    if name in EVALUATED:
        np.testing.assert_allclose(ref_eval, ev, rtol=TOL)
        np.testing.assert_allclose(ref_pred, pred, rtol=TOL, atol=1e-6)
    assert rel_diff(tiny(CASES[name][3]).get_weights(), model.get_weights()) > 1e-2
    shard, n = CASES[name][:2]
    text = parallel.describe()
    assert f"shard={shard!r}" in text and f"gradients {''}" in text
    assert f"the optimizer on this rank's 1/{n} of the state" in text


def test_second_fit_save_and_load_continue(fits, tmp_path):
    """A second fit and a saved-then-loaded model go on as plain Keras does (shard=
    "weights" on 4 ranks)."""
    name = "global_clipnorm" if "global_clipnorm" in RUN else RUN[0]  # N=4, the last pool
    shard, n, make_opt, dtype = CASES[name]
    (ref, *_), (model, _, parallel, *_) = fits[name]
    model.save(tmp_path / "sharded.keras")
    ref.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    parallel.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(opt_state(ref), opt_state(model)) <= TOL
    loaded = keras.saving.load_model(tmp_path / "sharded.keras")
    again = kmgpu.parallelize(loaded, gpus=n, shard=shard, sync_batchnorm=dtype is None)
    again.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    again.close()
    assert rel_diff(ref.get_weights(), loaded.get_weights()) <= TOL
    assert rel_diff(opt_state(ref), opt_state(loaded)) <= TOL


@pytest.mark.parametrize("name", RUN)
def test_each_rank_keeps_one_nth(fits, name):
    """Between calls every rank's step holds its 1/N pieces (as the layout pads them) of
    the gradient and the optimizer state, and with shard="weights" of the weights too;
    rank 0 as well (the whole state gathered for the user's model is let go after fit).
    Where the gradient is all-reduced whole (global_clipnorm, mixed_float16's loss
    scale) no piece of it is kept at all."""
    from kmgpu.engines.torch.optim import flat_layout, flat_optim, sizes

    shard, n = CASES[name][:2]
    _, (model, _, parallel, *_) = fits[name]
    by_layer = shard == "weights"
    trainable = model.trainable_weights
    piece = sizes.grad_bytes(model, n, by_layer)[0]
    groups = flat_layout.layer_groups(trainable) if by_layer else [None] * len(trainable)
    whole_padded = piece * n
    assert sum(v.value.numel() for v in trainable) * 4 < whole_padded  # alignment padding
    slots = len(flat_layout_slots(model))
    lso, opt = flat_optim.scaler(model.optimizer)
    summed_whole = bool(opt.global_clipnorm or lso)
    assert len(HELD[name]) == n
    for held in HELD[name]:
        assert held["optimizer"] == slots * piece
        assert held["gradients"] == (0 if summed_whole else piece)
        assert held["weights"] == (piece if by_layer else whole_padded)
    per, whole, kept = parallel._engine.sharded_bytes(model, "optimizer")
    assert per - kept == slots * piece and whole - kept == slots * sum(
        v.value.numel() * 4 for v in trainable)
    assert len(set(groups)) == (4 if by_layer else 1)


def flat_layout_slots(model):
    from kmgpu.engines.torch.optim import flat_optim

    inner = flat_optim.scaler(model.optimizer)[1]
    return [s for s in flat_optim.SLOTS[flat_optim.kind(inner)] if s[2] is None or s[2](inner)]


def test_a_layer_is_gathered_where_used_and_freed_after():
    """In one process (rank 0 of 2, the other rank's piece copied in by a stand-in for
    the all-gather): under shard="weights" Keras's forward and backward read each
    layer's weights only after its buffer was gathered, at most ``fsdp.KEEP`` layers
    in use and ``fsdp.PREFETCH`` gathered ahead are whole at any time, every buffer is
    freed afterwards, and the gradients equal the unsharded model's. With a GPU's
    prefetch (a CPU device gathers nothing ahead by default), the second step
    starts each gather ahead of its use in the first step's order (its stand-in fills
    the buffer only at the wait), and gathers as often as the first; a third step
    gathers into the memory the steps before freed (host memory: no layer-sized block
    allocated anew)."""
    from kmgpu.engines.torch.optim import fsdp, zero

    ref = tiny()
    grads_ref = batch_grads(ref)
    model = tiny()
    whole = [v.value.detach().clone() for v in model.trainable_weights]
    shards = zero.Shards(O.Adam(0.01), model.trainable_weights, 0, 2, transient=True,
                         weights=True)
    flats = shards.flat.params
    assert all(fsdp.is_free(f) for f in flats) and len(flats) == 4  # one per layer
    # the stand-in all-gather: the whole buffer laid out from the original values
    full = [f.new_zeros(f.numel()) for f in flats]
    for view, w in zip(shards.flat.weights.like(full), whole):
        view.copy_(w)
    most, log = [], []

    def gather(out, piece, async_op=False):
        k = next(i for i, p in enumerate(shards.flat.pieces) if p.params is piece)
        most.append(sum(not fsdp.is_free(f) for f in flats))
        log.append(("ahead" if async_op else "now", k))
        memory[-1].add(out.data_ptr())
        if async_op:
            return Deferred(out, lambda: full[k], lambda: log.append("wait"))
        out.copy_(full[k])

    shards.gathering.gather = gather
    assert shards.gathering.prefetch == fsdp.HOST_PREFETCH == 0  # the host's policy
    shards.gathering.prefetch = fsdp.PREFETCH  # a GPU's: gathers started ahead
    steps, memory = [], []
    for _ in range(3):
        del log[:]
        memory.append(set())
        with shards.active():
            grads = batch_grads(model)
        steps.append((grads, list(log)))
        assert all(fsdp.is_free(f) for f in flats)
    (first, log1), (second, log2), _ = steps
    assert max(most) <= fsdp.KEEP + fsdp.PREFETCH
    gathered = [k for _, k in log1]
    assert len(gathered) >= 2 * len(flats) - fsdp.KEEP and all(w == "now" for w, _ in log1)
    # the second step: the same buffers in the same order, all but the first ahead,
    # each waited for once
    assert [k for _, k in (e for e in log2 if e != "wait")] == gathered
    assert [e for e in log2 if e != "wait"][1:] == [("ahead", k) for k in gathered[1:]]
    assert log2.count("wait") == len(gathered) - 1
    assert shards.gathering.prefetches == 2 * (len(gathered) - 1)  # the second and third
    assert memory[2] <= memory[0] | memory[1]
    for grads in (first, second):
        for a, b in zip(grads_ref, grads):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make_opt, says", [
    (lambda: O.Lamb(), "shard='weights' on torch shards an update that is elementwise.*"
                       "KERAS_BACKEND=jax"),
    (lambda: O.Adam(use_ema=True), "use_ema needs every weight whole.*shard='gradients'")])
def test_what_cannot_be_sharded_is_refused_before_any_work(make_opt, says):
    model = tiny()
    before = model.get_weights()
    parallel = kmgpu.parallelize(model, gpus=2, shard="weights", sync_batchnorm=True)
    parallel.compile(optimizer=make_opt(), loss="mse")
    with pytest.raises(ValueError, match=says):
        parallel.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    assert rel_diff(before, model.get_weights()) == 0.0 and not model.optimizer.built


class _Unused(keras.layers.Layer):
    """A kernel, and a weight its call never reads (it gets no gradient)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 1))
        self.unused = self.add_weight(shape=(3,))

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)


def test_a_variable_without_gradient_is_refused():
    """shard="weights" with a trainable variable that gets no gradient: every rank
    reduce-scatters its layer at the backward pass's end (zeros for it), so the ranks
    stay in step, and the update refuses the step, saying what to do."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                              _Unused()])
    parallel = kmgpu.parallelize(model, gpus=2, shard="weights")
    parallel.compile(optimizer=O.Adam(0.01), loss="mse")
    try:
        with pytest.raises(ValueError, match="some trainable variables get no gradient"):
            parallel.fit(X.astype("float32"), Y, batch_size=BATCH, epochs=1, verbose=0)
    finally:
        parallel.close()


def test_forward_replayed_with_layers_gathered_inside_it(monkeypatch, capsys):
    """shard="weights" on 2 ranks with graph A 'replayed' (a fake capture, inherited by
    the forked workers; graph B's capture failing, so the update runs eagerly after it):
    the layers' gathers and the step's own gradient buffers happen inside the capture,
    and each replay's exchange reads the buffers that graph wrote; still one device's
    result, and 1/N kept."""
    from kmgpu.engines.torch.launch import launchers
    from kmgpu.engines.torch.optim import sizes
    from tests.torch.test_captured_step import _forced_capture
    from tests.torch.test_zero import mlp, X as X5, Y as Y5

    launchers.close_pools()
    try:
        _forced_capture(monkeypatch, fail_update=True)
        ref, model = mlp(), mlp()
        parallel = kmgpu.parallelize(model, gpus=2, shard="weights")
        for runner in (ref, parallel):
            runner.compile(optimizer=O.Adam(0.01), loss="mse")
        ref_history = ref.fit(X5, Y5, batch_size=8, epochs=2, shuffle=False, verbose=0)
        history = parallel.fit(X5, Y5, batch_size=8, epochs=2, shuffle=False, verbose=0)
        held = parallel._engine.rank_held_bytes()
        parallel.close()
        assert "run eagerly after the captured" in capsys.readouterr().out
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
        assert rel_diff(opt_state(ref), opt_state(model)) <= TOL
        np.testing.assert_allclose(ref_history.history["loss"], history.history["loss"],
                                   rtol=TOL)
        piece = sizes.grad_bytes(model, 2, by_layer=True)[0]
        assert held[0] == held[1] and held[0]["weights"] == held[0]["gradients"] == piece
    finally:
        launchers.close_pools()  # no worker keeps the fake capture


#: the rank counts the global mixed_float16 policy's shard="weights" runs take
MIXED_NS = (2, 4)


@pytest.fixture(scope="module")
def mixed_fits(fits):
    """Under the global mixed_float16 policy (set here, the one before put back after the
    fits) with plain Adam (Keras's compile wraps it in a LossScaleOptimizer): one device,
    and on each of ``MIXED_NS`` ranks kmgpu unsharded and with shard="weights" (BatchNorm
    over the global batch). The pools forked under the policy are closed after.

    After ``fits``: its worker pools of 2 and 4 ranks were started under float32, so
    these runs also show that a pool started under other global Keras settings is
    replaced, not reused (its workers would compile without the LossScaleOptimizer)."""
    from kmgpu.engines.torch.launch import launchers

    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    out = {}
    try:
        out[1] = _fit(lambda: O.Adam(0.01), None)
        for n in MIXED_NS:
            for shard in (None, "weights"):
                out[n, shard] = _fit(lambda: O.Adam(0.01), None, n, shard)
                out[n, shard][2].close()
    finally:
        keras.mixed_precision.set_global_policy(before)
        launchers.close_pools()
    return out


def _differences(ref, run):
    """What a run's weights, optimizer variables, History, evaluate and predict differ
    by from ``ref``'s (``rel_diff``: per tensor, relative to its largest value)."""
    (ref_model, ref_history, _, ref_eval, ref_pred), (model, history, _, ev, pred) = ref, run
    return {"weights": rel_diff(ref_model.get_weights(), model.get_weights()),
            "optimizer": rel_diff(opt_state(ref_model), opt_state(model)),
            **{f"history {key}": rel_diff([ref_history[key]], [history[key]])
               for key in ref_history},
            "evaluate": rel_diff([ref_eval], [ev]), "predict": rel_diff([ref_pred], [pred])}


@pytest.mark.skipif("weights" not in TorchEngine.shards, reason="no shard='weights' yet")
@pytest.mark.parametrize("n", MIXED_NS)
def test_weights_sharded_under_mixed_float16_equal_one_device(mixed_fits, n):
    """shard="weights" under the global mixed_float16 policy: Keras's symbolic build at
    the first fit and evaluate calls the model, whose float16 casts of the weights read
    the freed layer buffers unless it runs within the layers' gathering. Weights,
    optimizer variables (the LossScaleOptimizer's scale and counters among them),
    History, evaluate and predict equal one device as closely as kmgpu's unsharded run
    on as many ranks does (float16 sums of each rank's rows round apart from one
    device's sums of the whole batch: measured about 3e-4 for the weights, 2e-3 for the
    optimizer's moments, 3e-5 for the History, 6e-4 for the float16 predictions, so 1e-5
    cannot hold), and equal that unsharded run to 1e-5 (measured: bit for bit)."""
    one, unsharded, sharded = mixed_fits[1], mixed_fits[n, None], mixed_fits[n, "weights"]
    model = sharded[0]
    assert model.dtype_policy.name == "mixed_float16"
    assert isinstance(model.optimizer, O.LossScaleOptimizer)
    assert int(model.optimizer.iterations.numpy()) == int(one[0].optimizer.iterations.numpy())
    assert rel_diff(tiny().get_weights(), model.get_weights()) > 1e-2
    bound = _differences(one, unsharded)
    for what, d in _differences(one, sharded).items():
        assert d <= max(TOL, bound[what]), (what, d, bound[what])
    for what, d in _differences(unsharded, sharded).items():
        assert d <= TOL, (what, d)

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
"""

import weakref

import keras
import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import kmgpu
from kmgpu.engines.torch.engine import TorchEngine
from tests.helpers import rel_diff

TOL = 1e-5
O = keras.optimizers
ROWS, BATCH = 90, 8
_rng = np.random.default_rng(3)
X = _rng.integers(0, 9, size=(ROWS, 4)).astype("int32")
Y = (X.sum(axis=1, keepdims=True) / 9.0 + 0.1 * _rng.normal(size=(ROWS, 1))).astype("float32")


def tiny(dtype=None):
    """Embedding(9, 3) 27 + Dense(5) 60 (no bias: BatchNorm follows) + BatchNormalization
    10 + Dense(1) 6 = 103 trainable parameters."""
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((4,), dtype="int32"), keras.layers.Embedding(9, 3, dtype=dtype),
        keras.layers.Flatten(dtype=dtype), keras.layers.Dense(5, use_bias=False, dtype=dtype),
        keras.layers.BatchNormalization(dtype=dtype),
        keras.layers.Activation("relu", dtype=dtype), keras.layers.Dense(1, dtype=dtype)])


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


def _state(model):
    return [v.numpy() for v in model.optimizer.variables]


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
    assert rel_diff(_state(ref), _state(model)) <= TOL  # the whole state, gathered back
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
    assert rel_diff(_state(ref), _state(model)) <= TOL
    loaded = keras.saving.load_model(tmp_path / "sharded.keras")
    again = kmgpu.parallelize(loaded, gpus=n, shard=shard, sync_batchnorm=dtype is None)
    again.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    again.close()
    assert rel_diff(ref.get_weights(), loaded.get_weights()) <= TOL
    assert rel_diff(_state(ref), _state(loaded)) <= TOL


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


def test_a_layer_is_gathered_where_used_and_freed_after(monkeypatch):
    """In one process (rank 0 of 2, the other rank's piece copied in by a stand-in for
    the all-gather): under shard="weights" Keras's forward and backward read each
    layer's weights only after its buffer was gathered, at most ``fsdp.KEEP`` layers are
    whole at any time, every buffer is freed afterwards, and the gradients equal the
    unsharded model's."""
    from kmgpu.engines.torch.optim import fsdp, zero

    ref = tiny()
    grads_ref = _grads(ref)
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
    most = []

    def gather(out, piece):
        k = next(i for i, p in enumerate(shards.flat.pieces) if p.params is piece)
        out.copy_(full[k])
        most.append(sum(not fsdp.is_free(f) for f in flats))

    shards.gathering.gather = gather
    with shards.active():
        grads = _grads(model)
    assert max(most) <= fsdp.KEEP and len(most) >= 2 * len(flats) - fsdp.KEEP
    assert all(fsdp.is_free(f) for f in flats)
    for a, b in zip(grads_ref, grads):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _grads(model, keep=False):
    x = keras.ops.convert_to_tensor(X[:8])
    loss = keras.ops.mean((model(x, training=True) - keras.ops.convert_to_tensor(Y[:8])) ** 2)
    grads = torch.autograd.grad(loss, [v.value for v in model.trainable_weights])
    return list(grads) if keep else [g.numpy() for g in grads]


def test_each_layer_gradient_is_reduce_scattered_as_backward_makes_it():
    """In one process (rank 0 of 2, stand-ins for the collectives: the other rank's
    gradient taken to equal this one's): under shard="weights" each layer buffer's
    gradient is reduce-scattered inside the backward pass, once, the last layer first,
    from a buffer as long as that layer's; the pieces equal the unsharded gradient's, and
    autograd is left holding no gradient memory."""
    from kmgpu.engines.torch.optim import zero

    ref_grads = _grads(tiny())
    model = tiny()
    whole = [v.value.detach().clone() for v in model.trainable_weights]
    shards = zero.Shards(O.Adam(0.01), model.trainable_weights, 0, 2, transient=True,
                         weights=True)
    layout, pieces = shards.flat.weights, shards.flat.pieces
    full = [f.new_zeros(f.numel()) for f in layout.flats]
    for view, w in zip(layout.like(full), whole):
        view.copy_(w)
    shards.gathering.gather = lambda out, piece: out.copy_(
        full[next(k for k, p in enumerate(pieces) if p.params is piece)])
    shards.grad_buffers(layout.flats)  # (the split step's gradient layout: the same)
    sent = []

    def scatter(piece, flat):
        k = next(k for k, p in enumerate(shards.grad_pieces) if p is piece)
        sent.append((k, flat.numel(), torch._C._current_graph_task_id() != -1))
        piece.copy_(flat[:piece.numel()] * 2)  # rank 0's piece, summed over 2 equal ranks

    assert shards.by_layer
    with shards.scattered():
        shards.scattering.scatter = scatter
        with shards.active():
            grads = _grads(model, keep=True)
    assert [k for k, *_ in sent] == [3, 2, 1, 0]  # Dense(1), BatchNorm, Dense(5), Embedding
    assert all(n == f.numel() and during for (_, n, during), f in zip(sent[::-1], layout.flats))
    assert all(g.untyped_storage().nbytes() <= g.element_size() for g in grads)
    ref = [f.new_zeros(f.numel()) for f in layout.flats]
    for view, g in zip(layout.like(ref), ref_grads):
        view.copy_(torch.from_numpy(g))
    for k, (piece, r) in enumerate(zip(shards.grad_pieces, ref)):
        np.testing.assert_allclose(piece.numpy(), 2 * r[:piece.numel()].numpy(), rtol=1e-6,
                                   atol=1e-7)


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
        assert rel_diff(_state(ref), _state(model)) <= TOL
        np.testing.assert_allclose(ref_history.history["loss"], history.history["loss"],
                                   rtol=TOL)
        piece = sizes.grad_bytes(model, 2, by_layer=True)[0]
        assert held[0] == held[1] and held[0]["weights"] == held[0]["gradients"] == piece
    finally:
        launchers.close_pools()  # no worker keeps the fake capture


# -- no whole copy on a rank's device (shard="weights") ---------------------------------
#: the metered model: four Dense(64) layers of 4160 parameters (16.6 kB each), so that
#: the 256-byte alignment padding is small beside a layer and one whole copy of the
#: weights (66.6 kB) is more than the slack the bound leaves; 41 rows at batch 4 end in
#: a batch of one row, so rank 1 runs its last step on a stand-in row
WIDE_X = np.random.default_rng(4).normal(size=(41, 64)).astype("float32")
WIDE_Y = WIDE_X[:, :1] * 0.5


def wide():
    keras.utils.set_random_seed(6)
    return keras.Sequential([keras.Input((64,))] +
                            [keras.layers.Dense(64, activation="tanh") for _ in range(3)] +
                            [keras.layers.Dense(64)])


class _DeviceMeter:
    """Peak bytes of weights and optimizer state a rank's device holds (see
    ``test_no_rank_device_holds_a_whole_copy``); made in a worker, one per replica."""

    DEVICE = torch.device("cpu:0")

    def __init__(self, worker):
        self.worker, self.on, self.peak, self.grad_peak = worker, True, 0, 0
        self.on_device = {}  # storage id -> made on the device
        self.params = weakref.WeakSet()  # every Parameter made since
        self.backward = {}  # storage id -> (a weak reference to it, its bytes): backward's

    def dispatch(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if not self.on:
            return out
        leaves = torch.utils._pytree.tree_leaves
        ins = {t.untyped_storage()._cdata for t in leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        device = kwargs.get("device")
        made_here = (torch.device(device) == self.DEVICE if device is not None
                     else any(self.on_device.get(c, False) for c in ins))
        in_backward = torch._C._current_graph_task_id() != -1
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in ins:
                st = t.untyped_storage()
                self.on_device[st._cdata] = made_here
                if in_backward:
                    self.backward[st._cdata] = (StorageWeakRef(st), st.nbytes())
        self.sample()
        return out

    def sample(self):
        held = list(self.params)
        strategy = self.worker.strategy
        step = strategy.sharded_step if strategy is not None else None
        if step is not None and step.zero is not None:
            held += list(step.zero.flat.params)
            held += [t for p in step.zero.flat.pieces for t in [p.params, *p.slots.values()]]
        seen, total = set(), 0
        for t in held:
            st = t.untyped_storage()
            if st._cdata not in seen and self.on_device.get(st._cdata, False):
                seen.add(st._cdata)
                total += st.nbytes()
        self.peak = max(self.peak, total)
        self.grad_peak = max(self.grad_peak, self.grad_bytes(step))

    def grad_bytes(self, step):
        """Gradient bytes held now: every storage the backward pass made that is still
        alive (autograd's gradients, a layer's flat gradient buffer, the activations'
        gradients), the step's whole flat gradient buffers and this rank's pieces."""
        for key in [c for c, (ref, _) in self.backward.items() if ref.expired()]:
            del self.backward[key]
        held = {c: n for c, (_, n) in self.backward.items()}
        if step is not None and step.zero is not None:
            flats = list(step.current.flats) if step.current is not None else []
            for t in flats + list(step.zero.grad_pieces or ()):
                held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(held.values())


def _install_meter(mp):
    """The workers forked after this (a pool of its own: its devices are named "cpu:0")
    meter each new replica's build, state load and first train step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kmgpu.engines.torch.launch import launchers, worker
    from kmgpu.engines.torch.launch.messages import Call
    from kmgpu.engines.torch.steps import split_step
    from kmgpu.engines.torch.strategy import DDPStrategy

    meters = []  # this process's (a worker's) current meter

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return meters[-1].dispatch(func, args, kwargs or {})

    init, handle, finish = launchers.PoolLauncher.__init__, worker.Worker.handle, \
        split_step.SplitStep.finish
    held, new_param = DDPStrategy.held_bytes, torch.nn.Parameter.__new__

    def init_(self, config):
        init(self, config)
        self.torch_devices = ["cpu:0" if d == "cpu" else d for d in self.torch_devices]

    def handle_(self, msg):
        if not (isinstance(msg, Call) and msg.key != self.key):
            return handle(self, msg)
        meters[:] = [_DeviceMeter(self)]
        # Keras's default is plain "cpu" again by now; on a GPU its default is the
        # worker's device: put "cpu:0" back as the worker's scope meant it
        with keras.device(self.device), Mode():
            return handle(self, msg)

    def finish_(self):
        finish(self)
        if meters:
            meters[-1].on = False  # the first step is over

    def param_(cls, data=None, requires_grad=True):
        p = new_param(cls, data, requires_grad)
        if meters and meters[-1].on:
            meters[-1].params.add(p)
        return p

    mp.setattr(launchers.PoolLauncher, "__init__", init_)
    mp.setattr(worker.Worker, "handle", handle_)
    mp.setattr(split_step.SplitStep, "finish", finish_)
    mp.setattr(torch.nn.Parameter, "__new__", staticmethod(param_))
    mp.setattr(DDPStrategy, "held_bytes", lambda self: {
        **(held(self) or {}), "device_peak": meters[-1].peak if meters else None,
        "grad_peak": meters[-1].grad_peak if meters else None})


@pytest.fixture(scope="module")
def metered():
    """shard="weights" and, to show the meter sees a whole copy, shard="gradients", on
    2 ranks with Adam: the wide model's weights after one epoch, one device's, and
    each rank's peaks (weights and optimizer state on the device, gradient)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        _install_meter(mp)
        ref = wide()
        ref.compile(optimizer=O.Adam(0.01), loss="mse")
        ref.fit(WIDE_X, WIDE_Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        for shard in ("weights", "gradients"):
            model = wide()
            parallel = kmgpu.parallelize(model, gpus=2, shard=shard)
            parallel.compile(optimizer=O.Adam(0.01), loss="mse")
            parallel.fit(WIDE_X, WIDE_Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            out[shard] = (model, parallel._engine.rank_held_bytes())
            parallel.close()
    return ref, out


def test_no_rank_device_holds_a_whole_copy(metered):
    """shard="weights": no rank's device holds the whole weights or optimizer state
    while its replica is built, the call's state is loaded and the first step runs:
    only its pieces and at most ``fsdp.KEEP`` gathered layers; the fit still equals
    one device.

    What is measured: on a CPU the host and the "device" are one memory, so no
    allocator can tell them apart. The ranks run on a device named "cpu:0" (the same
    memory; torch passes that name to every operation asked to allocate there, Keras's
    variables made in the worker's device scope included, while the engine's host
    memory is plain "cpu"). A TorchDispatchMode in each worker marks every storage an
    operation makes as the device's when the operation was asked for "cpu:0", or,
    asked for no device, read a device storage (a piece's new slot, a computed
    tensor); at every operation it adds up the bytes (now: a freed or regrown layer
    buffer counts as it is) of the device storages behind every torch Parameter made
    since the call began (every Keras variable: weights, optimizer slots, counters,
    metrics) and behind the engine's flat buffers and pieces. Activations and the
    step's gradient buffers are not counted. (The worker's Keras scope is set to
    "cpu:0" around the call, as a GPU worker's default device is its GPU.) The same
    meter on shard="gradients", which builds the replica on the device, sees more than
    the bound there.
    """
    from kmgpu.engines.torch.optim import fsdp, sizes

    ref, out = metered
    model, held = out["weights"]
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(_state(ref), _state(model)) <= TOL
    weights = sum(v.value.numel() * 4 for v in model.trainable_weights)  # 66 560
    whole = 3 * weights  # with Adam's two slots
    piece = sizes.grad_bytes(model, 2, by_layer=True)[0]  # a rank's pieces of the weights
    layer = max(-(-(64 * 65 * 4) // 512) * 512, 512)  # one layer's buffer, padded
    small = 1024  # the device's counters, learning rate, metrics, random seeds
    bound = 3 * piece + fsdp.KEEP * layer + small
    assert len(held) == 2
    for rank in held:
        assert rank["weights"] == piece
        peak = rank["device_peak"]
        assert 3 * piece <= peak <= bound, (peak, whole)
        assert peak < 0.75 * whole
    for rank in out["gradients"][1]:  # the replica whole on the device
        assert rank["device_peak"] > max(bound, weights), rank["device_peak"]


def test_no_rank_holds_the_whole_gradient_within_a_step(metered):
    """shard="weights": within a step a rank holds its gradient pieces and one layer's
    gradient at a time, never the whole model's: each layer's gradient is
    reduce-scattered within the backward pass as soon as it is complete, from a buffer
    as long as that layer's (reused by the next), and autograd's gradients are freed at
    once.

    The same meter as ``test_no_rank_device_holds_a_whole_copy`` adds up, at every
    operation of the first step, the bytes of every storage the backward pass made that
    is still alive (autograd's gradients, a layer's flat gradient buffer, the
    activations' gradients), of the step's whole flat gradient buffers and of this
    rank's gradient pieces. Measured per rank (2 ranks, pieces 33,792 bytes, the
    weights 66,560): shard="weights" 68,388 (it was 168,448 when the step made the
    whole buffers and reduce-scattered them after the backward pass: the pieces, the
    whole buffers and autograd's whole gradient); shard="gradients", which still does
    that, 166,912.
    """
    from kmgpu.engines.torch.optim import sizes

    _, out = metered
    model, held = out["weights"]
    weights = sum(v.value.numel() * 4 for v in model.trainable_weights)  # 66 560
    piece = sizes.grad_bytes(model, 2, by_layer=True)[0]  # a rank's gradient pieces
    layer = max(-(-(64 * 65 * 4) // 512) * 512, 512)  # one layer's buffer, padded
    small = 2048  # the activations' gradients (a few of rows x 64 floats), the stand-ins
    for rank in held:
        peak = rank["grad_peak"]
        # the pieces, one layer's buffer and, for the moment of its copy, autograd's
        # gradient of that layer
        assert piece + layer <= peak <= piece + 2 * layer + small, peak
        assert peak - piece < weights, peak  # never a whole gradient beside the pieces
    gradients_model, gradients_held = out["gradients"]
    whole = sizes.grad_bytes(gradients_model, 2)[0] * 2  # the whole buffer, padded
    for rank in gradients_held:  # the whole buffers and autograd's whole gradient
        assert rank["grad_peak"] >= whole + weights, rank["grad_peak"]

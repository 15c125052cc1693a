"""shard="weights" on torch: what a rank holds, and that a layer's weights are gathered
however its call reads them.

Memory: on a CPU the host and the "device" are one memory, so the ranks run on a device
named "cpu:0" and a TorchDispatchMode in each worker (``_DeviceMeter``) marks every
storage made there, or computed from one, as the device's; at every operation of the
replica's build, the call's state load and the first two steps (the second prefetches
the layers' gathers) it adds up the bytes of the
device storages behind the Keras variables and the engine's flat buffers and pieces
(``test_no_rank_device_holds_a_whole_copy``), and of every storage the backward pass made
that is still alive, with the gradient buffers and pieces
(``test_no_rank_holds_the_whole_gradient_within_a_step``): each rank's peak, against
bounds of its 1/N pieces plus the layers gathered or one layer's gradient, and against
shard="gradients" as a rank with whole copies. In one process, with stand-ins for the
collectives, each layer's gradient is reduce-scattered inside the backward pass from a
buffer as long as that layer's, autograd left holding none.

Gathering: a layer reads its variables through ``keras.ops``, the variables' own
operators (``x @ self.w``, ``x + self.b``: torch hands the mode the Keras variable
itself), ``self.w.value``, ``ops.convert_to_tensor`` and indexing; a model of layers,
each reading its weights first in one of those ways, trains on 2 ranks as on one device.
"""

import weakref

import keras
import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import kmgpu
from tests.helpers import rel_diff
from tests.torch.shard_cases import O, TOL, Deferred, batch_grads, opt_state, tiny


@pytest.mark.parametrize("slots", [1, 2], ids=["cpu-slots", "gpu-slots"])
def test_each_layer_gradient_is_reduce_scattered_as_backward_makes_it(slots):
    """In one process (rank 0 of 2, stand-ins for the collectives: the other rank's
    gradient taken to equal this one's): under shard="weights" each layer buffer's
    gradient is reduce-scattered inside the backward pass, once, the last layer first,
    from a buffer as long as that layer's; the pieces equal the unsharded gradient's, and
    autograd is left holding no gradient memory. The stand-in reduce-scatter is
    asynchronous and reads its buffer only at its handle's wait: the pieces are right
    only if no layer's copy reuses a buffer before its reduce-scatter is waited for, and
    every one is waited for by the block's end; with one buffer (a CPU device's) each
    copy waits for the reduce-scatter before it, with two (a GPU's) they take turns."""
    from kmgpu.engines.torch.optim import zero

    ref_grads = batch_grads(tiny())
    model = tiny()
    whole = [v.value.detach().clone() for v in model.trainable_weights]
    shards = zero.Shards(O.Adam(0.01), model.trainable_weights, 0, 2, transient=True,
                         weights=True)
    layout, pieces = shards.flat.weights, shards.flat.pieces
    full = [f.new_zeros(f.numel()) for f in layout.flats]
    for view, w in zip(layout.like(full), whole):
        view.copy_(w)

    def gather(out, piece, async_op=False):  # (one step: no prefetch, no handle)
        out.copy_(full[next(k for k, p in enumerate(pieces) if p.params is piece)])

    shards.gathering.gather = gather
    shards.grad_buffers(layout.flats)  # (the split step's gradient layout: the same)
    sent = []

    def scatter(piece, flat, async_op=False):
        k = next(k for k, p in enumerate(shards.grad_pieces) if p is piece)
        sent.append((k, flat.numel(), torch._C._current_graph_task_id() != -1))
        assert async_op
        # rank 0's piece, summed over 2 equal ranks, read from ``flat`` at the wait
        return Deferred(piece, lambda: flat[:piece.numel()] * 2,
                        lambda: waited.append(len(sent)))

    waited = []  # how many reduce-scatters had started at each wait
    assert shards.by_layer
    with shards.scattered():
        shards.scattering.scatter = scatter
        assert shards.scattering.slots == shards.scattering.HOST_SLOTS == 1  # on a CPU
        shards.scattering.slots = slots
        with shards.active():
            grads = batch_grads(model, keep=True)
    assert [k for k, *_ in sent] == [3, 2, 1, 0]  # Dense(1), BatchNorm, Dense(5), Embedding
    # two buffers take turns: the third layer's copy waits for the first layer's
    # reduce-scatter (two started by then), the fourth's for the second's; the last two
    # are waited for at the block's end. One buffer: each copy waits for the one before.
    assert waited == ([2, 3, 4, 4] if slots == 2 else [1, 2, 3, 4])
    assert all(n == f.numel() and during for (_, n, during), f in zip(sent[::-1], layout.flats))
    assert all(g.untyped_storage().nbytes() <= g.element_size() for g in grads)
    ref = [f.new_zeros(f.numel()) for f in layout.flats]
    for view, g in zip(layout.like(ref), ref_grads):
        view.copy_(torch.from_numpy(g))
    for k, (piece, r) in enumerate(zip(shards.grad_pieces, ref)):
        np.testing.assert_allclose(piece.numpy(), 2 * r[:piece.numel()].numpy(), rtol=1e-6,
                                   atol=1e-7)


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
        self.worker, self.on, self.peak, self.grad_peak, self.steps = worker, True, 0, 0, 0
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
    meter each new replica's build, state load and first two train steps (the second
    gathers each layer ahead of its use)."""
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
            meters[-1].steps += 1
            meters[-1].on = meters[-1].steps < 2  # the second step is over

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
        "grad_peak": meters[-1].grad_peak if meters else None,
        "prefetches": (self.sharded_step.zero.gathering.prefetches
                       if self.sharded_step.zero.gathering is not None else 0)})


@pytest.fixture(scope="module")
def metered():
    """shard="weights" and, to show the meter sees a whole copy, shard="gradients", on
    2 ranks with Adam: the wide model's weights after one epoch, one device's, and
    each rank's peaks (weights and optimizer state on the device, gradient)."""
    out = {}
    from kmgpu.engines.torch.optim import fsdp, scattering

    with pytest.MonkeyPatch.context() as mp:
        _install_meter(mp)
        # the ranks stand in for GPU workers: a GPU's prefetch and gradient slots
        mp.setattr(fsdp, "HOST_PREFETCH", fsdp.PREFETCH)
        mp.setattr(scattering.Scattering, "HOST_SLOTS", scattering.Scattering.SLOTS)
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
    while its replica is built, the call's state is loaded and the first two steps run:
    only its pieces and at most ``fsdp.KEEP`` layers in use and ``fsdp.PREFETCH``
    gathered ahead (which the second step does), less than a whole copy of the weights
    beside the pieces; the fit still equals one device.

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
    meter on shard="gradients", which builds the replica on the device, sees the whole
    weights there.
    """
    from kmgpu.engines.torch.optim import fsdp, sizes

    ref, out = metered
    model, held = out["weights"]
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(opt_state(ref), opt_state(model)) <= TOL
    weights = sum(v.value.numel() * 4 for v in model.trainable_weights)  # 66 560
    whole = 3 * weights  # with Adam's two slots
    piece = sizes.grad_bytes(model, 2, by_layer=True)[0]  # a rank's pieces of the weights
    layer = max(-(-(64 * 65 * 4) // 512) * 512, 512)  # one layer's buffer, padded
    small = 1024  # the device's counters, learning rate, metrics, random seeds
    bound = 3 * piece + (fsdp.KEEP + fsdp.PREFETCH) * layer + small
    assert len(held) == 2
    for rank in held:
        assert rank["weights"] == piece and rank["prefetches"] > 0
        peak = rank["device_peak"]
        assert 3 * piece <= peak <= bound, (peak, whole)
        assert peak < 3 * piece + weights  # a whole copy of the weights beside the pieces
    for rank in out["gradients"][1]:  # the whole weights beside the slots' pieces
        assert rank["device_peak"] >= weights + 2 * piece, rank["device_peak"]


def test_no_rank_holds_the_whole_gradient_within_a_step(metered):
    """shard="weights": within a step a rank holds its gradient pieces and two layers'
    gradients at a time, never the whole model's: each layer's gradient is
    reduce-scattered within the backward pass as soon as it is complete, from one of
    two buffers as long as a layer's (the next layer's copy fills the other while that
    reduce-scatter runs), and autograd's gradients are freed at once.

    The same meter as ``test_no_rank_device_holds_a_whole_copy`` adds up, at every
    operation of the first two steps, the bytes of every storage the backward pass made that
    is still alive (autograd's gradients, a layer's flat gradient buffer, the
    activations' gradients), of the step's whole flat gradient buffers and of this
    rank's gradient pieces. Measured per rank (2 ranks, pieces 33,792 bytes, the
    weights 66,560, a layer's buffer 16,896): shard="weights" 85,284; shard="gradients",
    which makes the whole
    buffers and reduce-scatters them after the backward pass (the pieces, the whole
    buffers and autograd's whole gradient), 166,912.
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
        # the pieces, two layers' buffers and, for the moment of its copy, autograd's
        # gradient of a layer
        assert piece + 2 * layer <= peak <= piece + 3 * layer + small, peak
        assert peak - piece < weights, peak  # never a whole gradient beside the pieces
    gradients_model, gradients_held = out["gradients"]
    whole = sizes.grad_bytes(gradients_model, 2)[0] * 2  # the whole buffer, padded
    for rank in gradients_held:  # the whole buffers and autograd's whole gradient
        assert rank["grad_peak"] >= whole + weights, rank["grad_peak"]


# -- every way a layer reads its variables gathers them (shard="weights") ---------------
class _Reads(keras.layers.Layer):
    """A kernel (4, 4) and a vector (4,) whose first read is ``form`` (each layer its
    own buffer, so each form is the first to read one), the rest through other forms."""

    def __init__(self, form, **kwargs):
        super().__init__(**kwargs)
        self.form = form

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(4,), initializer="random_normal")

    def call(self, x):
        ops, w, b = keras.ops, self.w, self.b
        if self.form == "matmul":  # torch's Tensor.__matmul__, then Tensor.__add__
            y = x @ w + b
        elif self.form == "rmatmul":  # the variable's __matmul__, then Tensor.__sub__
            y = ops.transpose(w @ ops.transpose(x)) - b
        elif self.form == "add":
            y = ops.matmul(x + b, w)
        elif self.form == "mul":
            y = ops.matmul(x * b, w)
        elif self.form == "sub":  # the variable's __sub__
            y = ops.matmul(b - x, w)
        elif self.form == "value":
            y = ops.matmul(x, w.value) + b.value
        elif self.form == "convert":
            y = ops.matmul(x, ops.convert_to_tensor(w)) * ops.convert_to_tensor(b)
        else:  # "index"
            y = x * b[0] + ops.matmul(x, w[:, :]) + b[1:2]
        return ops.tanh(y)

    def get_config(self):
        return {**super().get_config(), "form": self.form}


READS = ("matmul", "rmatmul", "add", "mul", "sub", "value", "convert", "index")


def reads():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((4,))] + [_Reads(f) for f in READS] +
                            [keras.layers.Dense(1)])


def test_every_way_a_layer_reads_its_variables_gathers_them():
    """shard="weights" on 2 ranks with Adam: layers that read their variables through
    the variables' own operators (``x @ self.w``: a torch tensor's operator, which hands
    torch the Keras variable itself), ``self.w.value``, ``ops.convert_to_tensor`` and
    indexing train as one device does: weights and optimizer variables to 1e-5."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = np.tanh(x.sum(axis=1, keepdims=True))
    ref, model = reads(), reads()
    parallel = kmgpu.parallelize(model, gpus=2, shard="weights")
    try:
        for runner in (ref, parallel):
            runner.compile(optimizer=O.Adam(0.01), loss="mse")
            runner.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    finally:
        parallel.close()
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(opt_state(ref), opt_state(model)) <= TOL
    assert rel_diff(reads().get_weights(), model.get_weights()) > 1e-2  # it trained

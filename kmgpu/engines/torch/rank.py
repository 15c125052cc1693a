"""What one torch rank does inside an initialised process group.

Shared by the two process models of the torch engine: a worker of kmgpu's pool
(``_torch_pool``) and a process of a job the user started with torchrun
(``torch.TorchEngine`` in-process mode). Nothing here starts processes.

How one global batch becomes N equal steps
------------------------------------------
Every rank sees the full arrays (memory-mapped in pool mode, the script's own
arrays under torchrun) and feeds Keras's ``fit`` a ``keras.utils.PyDataset``
(``RankSlices``) that yields, for global batch ``s``, the rank's contiguous
slice of it (sizes differ by at most one row). Every rank therefore runs the
same number of steps. A rank whose slice of a small last batch is empty gets
one stand-in row and a weight of zero, so it still joins every collective.

The step (``train_step`` below, the documented Keras extension point) runs the
forward pass through ``DistributedDataParallel`` and weights the rank's mean loss
by ``n_local / n_global`` before ``backward``; DDP's buckets are summed (not
averaged) by a comm hook, so the update equals the one-device update of the
global batch, also for a partial last batch. Keras's loss tracker is updated
with the rank's own loss and row count, and at the end of every epoch and
evaluation the metric variables (Keras keeps additive totals and counts) are
summed over ranks before Keras reads them.
"""

import math

import numpy as np
import torch
import torch.distributed as dist

import keras
from keras.src import tree
from keras.src.backend.torch.trainer import TorchTrainer
from keras.src.trainers.data_adapters import array_slicing
from keras.src.trainers.data_adapters import data_adapter_utils

from kmgpu import models


# -- who am I --------------------------------------------------------------------------
class RankContext:
    """This rank's place in the group and the state its hooks share.

    Args:
        device: the torch device the replica and the collectives live on.
        sync_batchnorm: compute BatchNormalization moments over the global batch.
    """

    def __init__(self, device, sync_batchnorm):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(device)
        self.sync_batchnorm = sync_batchnorm
        self.train = None        # the RankSlices feeding the current fit
        self.test = None         # ... the current evaluate (also fit's validation)
        self.collective = False  # metric variables are summed over ranks when read
        self.n_real = None       # real rows of this rank's current training batch
        self.in_train_step = False


def split(n, world, rank):
    """Rows [lo, hi) of ``n`` that ``rank`` of ``world`` takes (contiguous, near-even)."""
    q, rem = divmod(n, world)
    lo = rank * q + min(rank, rem)
    return lo, lo + q + (1 if rank < rem else 0)


# -- data -----------------------------------------------------------------------------
def _rows(structure):
    leaves = [leaf for leaf in tree.flatten(structure) if leaf is not None]
    return int(leaves[0].shape[0]) if leaves else 0


class ArraySource:
    """Full arrays (x, y, sample_weight structures) cut into global batches."""

    def __init__(self, x, y=None, sample_weight=None):
        self.parts = tuple(p for p in (x, y, sample_weight))
        while len(self.parts) > 1 and self.parts[-1] is None:
            self.parts = self.parts[:-1]
        self.n = _rows(x)

    def num_batches(self, batch_size):
        return math.ceil(self.n / batch_size)

    def batch(self, s, batch_size, order):
        """The rows of global batch ``s``: a slice, or indices when shuffled."""
        lo, hi = s * batch_size, min(self.n, (s + 1) * batch_size)
        return (slice(lo, hi) if order is None else order[lo:hi]), hi - lo

    def take(self, rows):
        return tree.map_structure(
            lambda a: None if a is None else np.ascontiguousarray(a[rows]), self.parts
        )


class DatasetSource:
    """A user's ``keras.utils.PyDataset``: its batches are the global batches."""

    def __init__(self, dataset):
        self.dataset = dataset

    def num_batches(self, batch_size):
        return len(self.dataset)

    def batch(self, s, batch_size, order):
        index = s if order is None else int(order[s])
        data = self.dataset[index]
        if isinstance(data, np.ndarray) or not isinstance(data, (tuple, list)):
            data = (data,)
        self._data = tuple(data)
        return slice(0, _rows(self._data[0])), _rows(self._data[0])

    def take(self, rows):
        return tree.map_structure(
            lambda a: None if a is None else np.ascontiguousarray(np.asarray(a)[rows]),
            self._data,
        )


class StoredBatches(keras.utils.PyDataset):
    """A user's PyDataset the parent read once and stored as arrays and batch bounds
    (for datasets that cannot be pickled to the workers)."""

    def __init__(self, parts, bounds):
        super().__init__()
        self.parts, self.bounds = parts, list(bounds)
        self._loaded = False

    def __len__(self):
        return len(self.bounds) - 1

    def __getitem__(self, i):
        if not self._loaded:
            from kmgpu.engines.torch.pool import resolve

            self.parts, self._loaded = resolve(self.parts), True
        lo, hi = self.bounds[i], self.bounds[i + 1]
        return tree.map_structure(lambda a: None if a is None else a[lo:hi], self.parts)


class RankSlices(keras.utils.PyDataset):
    """This rank's contiguous slice of every global batch, as a Keras PyDataset.

    ``current`` is (real rows here, rows in the global batch) of the batch handed
    out last; Keras's torch trainer fetches a batch right before it runs the step
    on it (no prefetch with ``workers=1``), so the step reads it from here.
    """

    def __init__(self, source, batch_size, ctx, shuffle=False, seed=0):
        super().__init__()
        self.source, self.batch_size, self.ctx = source, batch_size, ctx
        self.shuffle, self.seed = shuffle, seed
        self.current = (0, 0)
        self._passes = 0
        self._order = None
        self._len = source.num_batches(batch_size)

    def __len__(self):
        return self._len

    def on_epoch_begin(self):
        self._passes += 1

    def _new_order(self):
        # The same permutation on every rank: the seed is shared, not per rank.
        rng = np.random.default_rng([self.seed, self._passes])
        if isinstance(self.source, DatasetSource) or self.shuffle == "batch":
            if isinstance(self.source, DatasetSource):
                return rng.permutation(self._len)
            blocks = rng.permutation(self._len)
            return np.concatenate([
                np.arange(b * self.batch_size, min(self.source.n, (b + 1) * self.batch_size))
                for b in blocks
            ])
        return rng.permutation(self.source.n)

    def steps_rows(self, s):
        """(lo, hi) within the global batch ``s`` for this rank, and its size."""
        _, n_global = self._global(s)
        return split(n_global, self.ctx.world, self.ctx.rank), n_global

    def _global(self, s):
        return self.source.batch(s, self.batch_size, self._order)

    def __getitem__(self, s):
        if s == 0 and self.shuffle:
            self._order = self._new_order()
        rows, n_global = self._global(s)
        lo, hi = split(n_global, self.ctx.world, self.ctx.rank)
        n_real = hi - lo
        if n_real == 0:  # stand-in row, weight 0: the rank still joins the collectives
            lo, hi = 0, 1
        if isinstance(rows, slice):
            local = slice(rows.start + lo, rows.start + hi)
        else:
            local = rows[lo:hi]
        self.current = (n_real, n_global)
        return self.source.take(local)


def predict_positions(n, batch_size, world, rank, steps):
    """Where this rank's predict rows go in the output, and which of them are real."""
    keep, where = [], []
    for s in range(steps):
        g_lo = s * batch_size
        n_global = min(n, g_lo + batch_size) - g_lo
        lo, hi = split(n_global, world, rank)
        if hi > lo:
            keep.append(np.ones(hi - lo, bool))
            where.append(np.arange(g_lo + lo, g_lo + hi))
        else:
            keep.append(np.zeros(1, bool))
    return np.concatenate(keep), (np.concatenate(where) if where else np.zeros(0, int))


# -- collectives ----------------------------------------------------------------------
_WIRE = {torch.bool: torch.uint8, torch.uint16: torch.int32, torch.uint32: torch.int64,
         torch.uint64: torch.int64}


def _grouped(tensors):
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def broadcast_tensors(tensors, ctx, src=0):
    """Overwrite ``tensors`` (in place) with rank ``src``'s values, one message per dtype."""
    with torch.no_grad():
        for dtype, idx in _grouped(tensors).items():
            wire = _WIRE.get(dtype, dtype)
            flat = torch.cat([tensors[i].detach().reshape(-1).to(ctx.device, wire) for i in idx])
            dist.broadcast(flat, src)
            offset = 0
            for i in idx:
                t = tensors[i]
                t.copy_(flat[offset:offset + t.numel()].view(t.shape).to(t.device, dtype))
                offset += t.numel()


def sum_tensors(tensors, ctx):
    """The sums over ranks of ``tensors`` (new tensors; inputs untouched)."""
    out = [None] * len(tensors)
    with torch.no_grad():
        for dtype, idx in _grouped(tensors).items():
            wire = torch.float64 if dtype in (torch.float16, torch.bfloat16) else _WIRE.get(dtype, dtype)
            flat = torch.cat([tensors[i].detach().reshape(-1).to(ctx.device, wire) for i in idx])
            dist.all_reduce(flat)
            offset = 0
            for i in idx:
                t = tensors[i]
                out[i] = flat[offset:offset + t.numel()].view(t.shape).to(t.device, dtype)
                offset += t.numel()
    return out


def _sum_hook(state, bucket):
    """DDP comm hook: sum gradients over ranks (the default averages them)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0]
    )


def _values(variables):
    return [v.value for v in variables]


def state_variables(replica):
    """Variables that must be equal on all ranks: weights, then optimizer variables."""
    out = list(replica.weights)
    opt = getattr(replica, "optimizer", None)
    if opt is not None and opt.built:
        out += list(opt.variables)
    return out


def broadcast_state(replica, ctx):
    """Rank 0's weights and optimizer state on every rank (identical start, not seeding)."""
    opt = getattr(replica, "optimizer", None)
    if opt is not None and not opt.built:
        opt.build(replica.trainable_variables)
    broadcast_tensors(_values(state_variables(replica)), ctx)


def _metric_variables(replica):
    seen, out = set(), []
    for m in replica.metrics:
        for v in m.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


# -- the replica -----------------------------------------------------------------------
def prepare(replica, ctx):
    """Turn a built, compiled Keras model into this rank's replica (in place).

    Installs the distributed train/test steps, sync BatchNorm, the metric
    reduction and the evaluate wrapper as instance attributes; the model's class
    and weights are untouched.
    """
    from torch.nn.parallel import DistributedDataParallel

    bn_layers = [l for l in replica._flatten_layers()
                 if isinstance(l, keras.layers.BatchNormalization)]
    if ctx.sync_batchnorm:
        for layer in bn_layers:
            layer._moments = _sync_moments(layer, ctx)
        averaged = []
    else:
        averaged = [v for l in bn_layers for v in l.non_trainable_weights
                    if "float" in str(v.dtype)]

    _offset_seeds(replica, ctx)
    for layer in models.stateful_layers(replica):
        _copy_states_in(layer)
    replica.jit_compile = False  # the step holds collectives; torch.compile stays out
    custom_step = type(replica).train_step is not TorchTrainer.train_step
    ddp = None
    if not custom_step and replica.trainable_weights:
        ddp = DistributedDataParallel(
            replica,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients live in DDP's buckets: no copies
            **_no_buffer_sync(),
        )
        ddp.register_comm_hook(None, _sum_hook)
        replica.train_step = _make_train_step(replica, ddp, ctx, averaged)
    else:
        _hook_optimizer(replica, ctx, averaged)
    if type(replica).test_step is TorchTrainer.test_step:
        replica.test_step = _make_test_step(replica, ctx)
    replica._get_metrics_result_or_logs = _make_metric_reduction(replica, ctx)
    replica.evaluate = _make_evaluate(replica, ctx)
    return replica


def _offset_seeds(replica, ctx):
    """Per-rank random streams (dropout etc.): each rank's SeedGenerators start apart."""
    if ctx.rank == 0:
        return
    for layer in replica._flatten_layers():
        for generator in getattr(layer, "_seed_generators", []) or []:
            state = np.asarray(generator.state.numpy()).astype(np.int64)
            state[0] = (state[0] + 1_000_003 * ctx.rank) % 2**32
            generator.state.assign(state.astype(generator.state.dtype))


def _copy_states_in(layer):
    """Run a stateful RNN layer from a copy of its states (this replica only).

    Keras 3.15's torch LSTM and GRU kernels (``backend.lstm`` / ``backend.gru``,
    which bypass ``RNN.inner_loop``'s own copy) multiply by the state variable's
    tensor itself, so autograd saves it; ``RNN.call`` then ``assign``s the new
    states into that tensor in place and ``backward`` fails ("modified by an
    inplace operation"). Given a copy as ``initial_state``, the layer computes
    the same and its own assign still carries the states to the next batch.
    """
    call = layer.call

    def call_from_copy(sequences, initial_state=None, **kwargs):
        if initial_state is None:
            initial_state = tree.map_structure(lambda v: v.value.clone(), layer.states)
        return call(sequences, initial_state=initial_state, **kwargs)

    layer.call = call_from_copy


def write_state_rows(replica, arrays, ctx):
    """This rank's rows of stateful RNN states given as arrays of all B rows.

    The replica is built for B/N rows; rank r owns rows r*B/N ... (r+1)*B/N - 1,
    the rows of every global batch ``RankSlices`` gives it.
    """
    for v, a in zip(models.state_variables(replica), arrays):
        b = int(v.shape[0])
        v.assign(np.asarray(a)[ctx.rank * b:(ctx.rank + 1) * b])


def state_rows(replica):
    """This rank's stateful RNN state rows, as arrays (empty list: none)."""
    return [keras.ops.convert_to_numpy(v.value) for v in models.state_variables(replica)]


def _no_buffer_sync():
    """Keras keeps no torch buffers; the argument's name changed in torch 2.13."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    try:
        params = inspect.signature(DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _average_statistics(variables, share, ctx):
    """Non-sync BatchNorm: moving statistics averaged over ranks, weighted by batch share."""
    if not variables or ctx.world == 1:
        return
    with torch.no_grad():
        sums = sum_tensors([v.value * share for v in variables], ctx)
        for v, s in zip(variables, sums):
            v.value.copy_(s)


def _make_train_step(replica, ddp, ctx, averaged):
    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if ctx.train is None:
            raise RuntimeError(
                "kmgpu: this replica trains only inside a distributed fit (a callback "
                "on rank 0 cannot call fit on it)."
            )
        n_real, n_global = ctx.train.current
        ctx.n_real, ctx.in_train_step = n_real, True
        try:
            if replica._call_has_training_arg:
                y_pred = ddp(x, training=True)
            else:
                y_pred = ddp(x)
        finally:
            ctx.in_train_step = False
        replica.zero_grad()
        loss = replica._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        if n_real:
            replica._loss_tracker.update_state(loss, sample_weight=n_real)
        share = n_real / n_global
        loss = replica.optimizer.scale_loss(loss) * share
        trainable = replica.trainable_weights[:]
        loss.backward()  # DDP sums the weighted gradients over ranks
        gradients = [v.value.grad for v in trainable]
        with torch.no_grad():
            replica.optimizer.apply(gradients, trainable)
        _average_statistics(averaged, share, ctx)
        if n_real:
            return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return replica.get_metrics_result()

    return train_step


def _hook_optimizer(replica, ctx, averaged):
    """A model with its own ``train_step``: average gradients in ``optimizer.apply``.

    Exact for even splits; kmgpu cannot weight a custom step's loss by batch share.
    """
    opt = getattr(replica, "optimizer", None)
    if opt is None:  # not compiled: predict only
        return
    apply = opt.apply

    def apply_synced(grads, trainable_variables=None):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        sums = sum_tensors([grads[i] for i in present], ctx)
        for i, s in zip(present, sums):
            grads[i] = s / ctx.world
        result = apply(grads, trainable_variables)
        _average_statistics(averaged, 1.0 / ctx.world, ctx)
        return result

    opt.apply = apply_synced


def _make_test_step(replica, ctx):
    def test_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        n_real = ctx.test.current[0] if ctx.test is not None else _rows(x)
        if replica._call_has_training_arg:
            y_pred = replica(x, training=False)
        else:
            y_pred = replica(x)
        loss = replica._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        if not n_real:
            return replica.get_metrics_result()
        replica._loss_tracker.update_state(loss, sample_weight=n_real)
        return replica.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return test_step


def _make_metric_reduction(replica, ctx):
    """Keras reads epoch/evaluation results here; sum metric variables over ranks first."""
    from keras.src.utils.python_utils import pythonify_logs

    read = TorchTrainer._get_metrics_result_or_logs.__get__(replica)

    def get_metrics_result_or_logs(logs):
        if not ctx.collective:
            return read(logs)
        variables = _metric_variables(replica)
        local = [v.value.detach().clone() for v in variables]
        try:
            with torch.no_grad():
                for v, s in zip(variables, sum_tensors(_values(variables), ctx)):
                    v.value.copy_(s)
            return pythonify_logs(read(logs))
        finally:
            with torch.no_grad():
                for v, s in zip(variables, local):
                    v.value.copy_(s)

    return get_metrics_result_or_logs


def _make_evaluate(replica, ctx):
    evaluate = TorchTrainer.evaluate.__get__(replica)

    def evaluate_(x=None, *args, **kwargs):
        mine = isinstance(x, RankSlices)
        saved = ctx.test, ctx.collective
        ctx.test, ctx.collective = (x, True) if mine else (None, False)
        try:
            return evaluate(x, *args, **kwargs)
        finally:
            ctx.test, ctx.collective = saved

    return evaluate_


class _SumOverRanks(torch.autograd.Function):
    """``dist.all_reduce`` (sum) with its gradient: the upstream gradients summed too.

    (``torch.distributed.nn.functional.all_reduce`` is this, deprecated in torch 2.13
    in favour of a private module.)
    """

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        return grad


def _sync_moments(layer, ctx):
    """BatchNormalization moments over the global batch (sums all-reduced with autograd)."""
    all_reduce = _SumOverRanks.apply
    local = layer._moments

    def moments(inputs, mask):
        if not ctx.in_train_step:
            return local(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs[: ctx.n_real]
        if mask is None:
            count = float(np.prod([x.shape[a] for a in axes]))
            s1 = torch.sum(x, dim=axes)
            s2 = torch.sum(x * x, dim=axes)
            n = torch.full_like(s1, count)
        else:
            w = mask[: ctx.n_real].to(x.dtype)
            w = torch.broadcast_to(w.unsqueeze(-1), x.shape)
            s1 = torch.sum(x * w, dim=axes)
            s2 = torch.sum(x * x * w, dim=axes)
            n = torch.sum(w, dim=axes)
        total = all_reduce(torch.stack([s1, s2, n]))
        mean = total[0] / total[2]
        variance = total[1] / total[2] - mean * mean
        return mean, variance

    return moments


# -- callbacks ------------------------------------------------------------------------
TRAIN_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
               "on_train_batch_begin", "on_train_batch_end")
TEST_HOOKS = ("on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end")
PREDICT_HOOKS = ("on_predict_begin", "on_predict_end", "on_predict_batch_begin",
                 "on_predict_batch_end")
_ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}


def implemented_hooks(callbacks):
    """The hooks the user's callbacks implement (Keras's own ``is_default`` test)."""
    from keras.src import utils

    out = set()
    for cb in callbacks or []:
        for hook in TRAIN_HOOKS + TEST_HOOKS + PREDICT_HOOKS + tuple(_ALIASES):
            method = getattr(cb, hook, None)
            if method is not None and not utils.is_default(method):
                out.add(_ALIASES.get(hook, hook))
    return out


class Abort(Exception):
    """A user callback raised (in the parent, or on rank 0 under torchrun): every rank
    leaves the call at the same point, so the pool stays usable."""


def plain_logs(logs):
    from keras.src.utils.python_utils import pythonify_logs

    if not logs:
        return logs
    return tree.map_structure(
        lambda v: keras.ops.convert_to_numpy(v) if hasattr(v, "shape") and v.shape else v,
        pythonify_logs(logs),
    )


class SyncCallback(keras.callbacks.Callback):
    """The one callback every rank runs: the user's callbacks run elsewhere, once.

    The user's callbacks run with the user's own model (in the parent process in
    pool mode, next to rank 0 under torchrun), driven by ``relay``: at each hook
    they implement, rank 0 sends the hook and its logs and gets back whether to
    stop training, the learning rate and whether a callback raised; rank 0 then
    broadcasts that to every rank, which apply it at the same point. Only those
    hooks cost a collective. On rank 0, ``snapshot`` saves the replica's state at
    every epoch end and at the end of training, before the hook is relayed, so
    the user's model holds the current weights when its callbacks look at it.
    """

    def __init__(self, ctx, relayed=(), relay=None, snapshot=None, reload=None):
        super().__init__()
        self.ctx, self.relayed, self.relay, self.snapshot = ctx, set(relayed), relay, snapshot
        self.reload = reload
        hooks = set(self.relayed)
        if snapshot is not None:
            hooks |= {"on_epoch_end", "on_train_end"}
        for hook in hooks:
            setattr(self, hook, self._bind(hook))

    def _bind(self, hook):
        def call(*args, **kwargs):
            self._event(hook, *args, **kwargs)

        return call

    def _lr(self):
        opt = getattr(self.model, "optimizer", None)
        lr = getattr(opt, "_learning_rate", None)
        return lr if isinstance(lr, keras.Variable) else None

    def _event(self, hook, *args, **kwargs):
        indexed = "batch" in hook or "epoch" in hook
        index = args[0] if indexed and args else None
        rest = args[1:] if indexed else args
        logs = rest[0] if rest else kwargs.get("logs")
        ctx = self.ctx
        if self.snapshot is not None and ctx.rank == 0 and hook in ("on_epoch_end",
                                                                    "on_train_end"):
            self.snapshot(self.model, index if hook == "on_epoch_end" else -1)
        if hook not in self.relayed:
            return
        # stop, has lr, lr, abort, reload the state, initial epoch (-1: None)
        values = [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
        if ctx.rank == 0:
            reply = self.relay(hook, index, plain_logs(logs), dict(self.params or {}))
            values[0] = float(bool(reply.get("stop")))
            if reply.get("lr") is not None:
                values[1], values[2] = 1.0, float(reply["lr"])
            values[3] = float(bool(reply.get("abort")))
            values[4] = float(bool(reply.get("reload")))
            if reply.get("initial_epoch") is not None:
                values[5] = float(reply["initial_epoch"])
            if isinstance(logs, dict) and isinstance(reply.get("logs"), dict):
                logs.update(reply["logs"])  # what the callbacks added, for the progress bar
        t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
        dist.broadcast(t, 0)
        stop, has_lr, lr_value, abort, reload, initial_epoch = t.tolist()
        if abort:
            raise Abort(hook)
        if hook == "on_train_begin":
            # what the user's callbacks set on their model (BackupAndRestore: the
            # restored weights and optimizer state, and the epoch to resume from)
            self.model._initial_epoch = int(initial_epoch) if initial_epoch >= 0 else None
            if reload:
                if ctx.rank == 0 and self.reload is not None:
                    self.reload(self.model)
                broadcast_state(self.model, ctx)
        if hook in TRAIN_HOOKS:
            self.model.stop_training = bool(stop)
        lr = self._lr()
        if has_lr and lr is not None:
            lr.assign(lr_value)


# -- one call -------------------------------------------------------------------------
def _source(x, y=None, sample_weight=None):
    if isinstance(x, keras.utils.PyDataset):
        return DatasetSource(x)
    return ArraySource(x, y, sample_weight)


def run(replica, ctx, method, kwargs, *, seed=0, hooks=(), relay=None, snapshot=None,
        reload=None, reset_states=False):
    """Run ``replica.<method>`` on this rank's share of the data.

    Args:
        replica: a model made by ``prepare``, with rank 0's state already broadcast.
        ctx: this rank's RankContext.
        method: "fit", "evaluate" or "predict".
        kwargs: Keras's keyword arguments with full (global) data and batch sizes,
            without ``callbacks`` (those run where ``relay`` sends the hooks).
        seed: the shuffling seed, the same on every rank.
        hooks: the hooks the user's callbacks implement (the same on every rank).
        relay: on rank 0, ``relay(hook, index, logs, params) -> reply`` runs them.
        snapshot: on rank 0, ``snapshot(replica, epoch)`` at every epoch end and
            with epoch -1 at the end of training (it decides whether to save).
        reload: on rank 0 in pool mode, ``reload(replica)`` loads the state the
            parent wrote after its on_train_begin callbacks changed the model.
        reset_states: zero the stateful RNN states now and, in fit, at the start
            of every epoch.

    Returns:
        {"aborted": True} if a user callback raised; else fit: None (the History
        is kept where the user's callbacks run); evaluate: Keras's return
        value (metrics summed over ranks); predict: this rank's (positions,
        predictions) with stand-in rows dropped.
    """
    kwargs = dict(kwargs)
    kwargs.pop("callbacks", None)
    verbose = kwargs.pop("verbose", "auto") if ctx.rank == 0 else 0
    kwargs.pop("verbose", None)
    replica.stop_training = False
    sync = SyncCallback(ctx, hooks, relay, snapshot if method == "fit" else None, reload)
    callbacks = [sync]
    if reset_states:
        models.reset_states(replica)
        callbacks.insert(0, models.reset_callback(replica))
    try:
        if method == "fit":
            return _fit(replica, ctx, kwargs, verbose, callbacks, seed)
        if method == "evaluate":
            data = RankSlices(_source(kwargs.pop("x"), kwargs.pop("y", None),
                                      kwargs.pop("sample_weight", None)),
                              kwargs.pop("batch_size"), ctx)
            return replica.evaluate(x=data, verbose=verbose, callbacks=[sync], **kwargs)
        if method == "predict":
            return _predict(replica, ctx, kwargs, verbose, sync)
    except Abort:
        return {"aborted": True}
    raise ValueError(method)


def _predict(replica, ctx, kwargs, verbose, sync):
    x = kwargs.pop("x")
    batch_size = kwargs.pop("batch_size")
    data = RankSlices(_source(x), batch_size, ctx)
    steps = min(kwargs.get("steps") or len(data), len(data))
    out = replica.predict(x=data, verbose=verbose, callbacks=[sync], **kwargs)
    if isinstance(x, keras.utils.PyDataset):
        return _dataset_positions(data, steps, out)
    keep, where = predict_positions(_rows(x), batch_size, ctx.world, ctx.rank, steps)
    return where, tree.map_structure(lambda a: np.asarray(a)[keep], out)


def _dataset_positions(data, steps, out):
    keep, where, offset = [], [], 0
    for s in range(steps):
        (lo, hi), n_global = data.steps_rows(s)
        if hi > lo:
            keep.append(np.ones(hi - lo, bool))
            where.append(np.arange(offset + lo, offset + hi))
        else:
            keep.append(np.zeros(1, bool))
        offset += n_global
    keep = np.concatenate(keep)
    where = np.concatenate(where) if where else np.zeros(0, int)
    return where, tree.map_structure(lambda a: np.asarray(a)[keep], out)


def _fit(replica, ctx, kwargs, verbose, callbacks, seed):
    x, y, sw = kwargs.pop("x"), kwargs.pop("y", None), kwargs.pop("sample_weight", None)
    batch_size = kwargs.pop("batch_size")
    validation_data = kwargs.pop("validation_data", None)
    validation_split = kwargs.pop("validation_split", 0.0)
    validation_batch_size = kwargs.pop("validation_batch_size", None) or batch_size
    shuffle = kwargs.pop("shuffle", True)
    if validation_split and validation_data is None:
        if isinstance(x, keras.utils.PyDataset):
            raise ValueError("validation_split needs arrays, not a PyDataset: pass "
                             "validation_data instead.")
        (x, y, sw), validation_data = array_slicing.train_validation_split(
            (x, y, sw), validation_split=validation_split
        )
    train = RankSlices(_source(x, y, sw), batch_size, ctx, shuffle=shuffle, seed=seed)
    val = None
    if validation_data is not None:
        if isinstance(validation_data, keras.utils.PyDataset):
            vsource = DatasetSource(validation_data)
        else:
            vsource = ArraySource(*data_adapter_utils.unpack_x_y_sample_weight(validation_data))
        val = RankSlices(vsource, validation_batch_size, ctx)
    ctx.train, ctx.collective = train, True
    try:
        replica.fit(x=train, validation_data=val, shuffle=False, verbose=verbose,
                    callbacks=callbacks, **kwargs)
    finally:
        ctx.train, ctx.collective = None, False
    return None  # the History is kept where the callbacks run

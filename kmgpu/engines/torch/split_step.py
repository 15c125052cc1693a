"""The split train step (``graphs``): A forward/backward into flat gradient buffers, the
all-reduce, B the optimizer, statistics, loss tracker and metrics; eager here, captured
as CUDA graphs by ``graphs.CapturedStep``. Split from graphs.py by role."""

import contextlib

import keras
import torch

from kmgpu.engines.torch import cond_keras_fixes, keras_fixes


class FlatBuffers:
    """Tensors laid out in one flat buffer per dtype; ``views[i]`` has tensor i's shape."""

    def __init__(self, tensors, device):
        sizes, slots = {}, []
        for t in tensors:
            offset = sizes.get(t.dtype, 0)
            slots.append((t.dtype, offset, t.numel(), tuple(t.shape)))
            sizes[t.dtype] = offset + t.numel()
        self.flats = [torch.zeros(n, dtype=d, device=device) for d, n in sizes.items()]
        by_dtype = dict(zip(sizes, self.flats))
        self.views = [by_dtype[d][o:o + n].view(shape) for d, o, n, shape in slots]


def _copy(dst, src):
    if hasattr(torch, "_foreach_copy_") and dst:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


def _unpack(data):
    return keras.utils.unpack_x_y_sample_weight(data)


class SplitStep:
    """Keras's train step in the three stages A / all-reduce / B (see the module).

    Args:
        model: the compiled model (a replica, or the user's model on one device).
        world: the number of replicas (1: no share weighting, no all-reduce).
        reduce: ``reduce(flats)`` sums the flat buffers over the replicas in place.
        averaged: BatchNorm moving statistics averaged over replicas (weighted by
            batch share) after every step.
        rows: ``rows(x)`` is (real rows here, rows in the global batch); None: one
            replica, every row real.
        forward: ``forward(n_real)`` is a context manager around the forward pass.
    """

    def __init__(self, model, *, world=1, reduce=None, averaged=(), rows=None, forward=None):
        self.model, self.world, self.reduce = model, world, reduce
        self.averaged = list(averaged)
        self.rows = rows or (lambda x: (_num_rows(x),) * 2)
        self.forward = forward or (lambda n_real: contextlib.nullcontext())
        self.trainable, self.buffers, self.used, self._key = None, None, None, None

    def layout(self):
        """(Re)make the flat buffers when the trainable variables changed; True if so."""
        trainable = self.model.trainable_weights[:]
        key = [id(v) for v in trainable]
        if self.buffers is not None and key == self._key:
            return False
        self.model.zero_grad(set_to_none=True)  # stale .grad from an eager step: free it
        tensors = [v.value for v in trainable] + [v.value for v in self.averaged]
        self.buffers = FlatBuffers(tensors, tensors[0].device)
        self.trainable, self._key, self.used = trainable, key, None
        return True

    @property
    def flats(self):
        return self.buffers.flats

    def forward_backward(self, x, y, sw, n_real, n_global):
        """Stage A: returns (loss, y_pred), both detached; the gradients are in ``flats``."""
        model = self.model
        with self.forward(n_real):
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
        loss, part = self._loss(x, y, y_pred, sw, n_real, n_global)
        scaled = model.optimizer.scale_loss(part)
        share = n_real / n_global if self.world > 1 else 1.0  # BatchNorm statistics
        grads = torch.autograd.grad(scaled, [v.value for v in self.trainable],
                                    allow_unused=True)
        if self.used is None:
            self.used = [g is not None for g in grads]
        n = len(self.trainable)
        views = self.buffers.views
        with torch.no_grad():
            _copy([views[i] for i in range(n) if grads[i] is not None],
                  [g for g in grads if g is not None])
            for i in range(n):
                if grads[i] is None:
                    views[i].zero_()
            for view, v in zip(views[n:], self.averaged):
                torch.mul(v.value, share, out=view)
        return loss.detach(), _map(lambda t: t.detach(), y_pred)

    def _loss(self, x, y, y_pred, sw, n_real, n_global):
        """(what the loss tracker gets, with weight n_real; this replica's part of the
        global loss): the rule of ``kmgpu.engines.keras_fixes.replica_loss``."""
        from kmgpu.engines import keras_fixes as common

        if self.world == 1:  # one replica: Keras's own loss, whatever its reductions
            loss = keras_fixes.compute_loss(self.model, x, y, y_pred, sw, training=True)
            return loss, loss

        def sum_weights(w):
            if self.reduce is None:
                return w
            total = (w * (1.0 if n_real else 0.0)).reshape(1).clone()  # a stand-in row: 0
            self.reduce([total])
            return total[0]

        kind, local, part = common.replica_loss(self.model, x, y, y_pred, sw, True, n_real,
                                                max(n_global, 1), sum_weights)
        if not n_real:  # a stand-in row: nothing of it counts
            return local, part * 0.0
        return common.tracker_update(kind, local, part, n_real, n_global)[0], part

    def update(self, x, y, sw, loss, y_pred, n_real, n_global):
        """Stage B, after the all-reduce: optimizer, statistics, loss tracker, metrics.

        Returns:
            Keras's logs (metric results as tensors).
        """
        model = self.model
        n = len(self.trainable)
        views = self.buffers.views
        with torch.no_grad():
            for view, v in zip(views[n:], self.averaged):
                v.value.copy_(view)
            grads = [g if used else None for g, used in zip(views[:n], self.used)]
            if not model.optimizer.built:  # its variables exist before the branches run
                model.optimizer.build(self.trainable)
            with cond_keras_fixes.device_conditions(model.optimizer, self.trainable):
                model.optimizer.apply(grads, self.trainable)
            if not n_real:  # a stand-in row: nothing of it counts
                return model.get_metrics_result()
            model._loss_tracker.update_state(loss, sample_weight=n_real)
            return model.compute_metrics(x, y, y_pred, sample_weight=sw)

    def step(self, x, y, sw, n_real, n_global):
        """A, all-reduce, B, eagerly."""
        loss, y_pred = self.forward_backward(x, y, sw, n_real, n_global)
        if self.reduce is not None:
            self.reduce(self.flats)
        return self.update(x, y, sw, loss, y_pred, n_real, n_global)


def _map(fn, structure):
    """``keras.tree.map_structure`` that leaves None alone (a leaf on torch)."""
    return keras.tree.map_structure(lambda t: None if t is None else fn(t), structure)


def _num_rows(x):
    leaves = [t for t in keras.tree.flatten(x) if t is not None]
    return int(leaves[0].shape[0])

"""The split train step (``graphs``): A forward/backward into flat gradient buffers, the
all-reduce, B the optimizer, statistics, loss tracker and metrics; eager here, captured
as CUDA graphs by ``graphs.CapturedStep``.

The gradients and the BatchNorm statistics to average share one ``flat_layout.Buffers``
per step: in each dtype's buffer the gradients come first, laid out as the flat
optimizer's weights (its gradient is that head, no copy), the statistics after them, so
unsharded one all-reduce per dtype sums both. shard="weights" (unless the gradient is
all-reduced whole) makes no whole gradient buffer: each layer's gradient is
reduce-scattered within the backward pass as soon as it is complete
(``zero.Shards.scattered``), and the step's buffers hold only the statistics."""

import contextlib

import keras
import torch

from kmgpu.engines import heap
from kmgpu.engines.torch import cond_fixes, step_fixes
from kmgpu.engines.torch.optim import flat_layout, flat_optim, fsdp, zero


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
        rank: this replica's rank, for ``shard``.
        shard: what is sharded over the ranks (``Config.shard``; True is "optimizer"):
            "optimizer" (``zero``, ZeRO-1): the gradient reduce-scattered, each rank's
            piece updated with its piece of the optimizer state, the weights
            all-gathered; "gradients" (ZeRO-2): the same, and the whole gradient
            buffers are made anew for each step and freed once reduce-scattered, so
            between steps a rank holds only its piece of the gradient (``transient``);
            "weights" (ZeRO-3, ``fsdp``): that, and each rank keeps only its piece of
            the weights, one flat buffer per layer gathered where the forward and the
            backward use it (``zero.Shards.active``), and each layer's gradient
            reduce-scattered within the backward pass as soon as it is complete
            (``by_layer``); None / False: all-reduced and updated whole on every rank.
    """

    def __init__(self, model, *, world=1, reduce=None, averaged=(), rows=None, forward=None,
                 rank=0, shard=False):
        self.model, self.world, self.reduce = model, world, reduce
        shard = "optimizer" if shard is True else (shard or None)
        self.rank, self.shard, self.zero = rank, shard, None
        #: the gradient buffers are made for each step and let go after it (ZeRO-2;
        #: ``by_layer``: only the statistics' buffers)
        self.transient = shard in ("gradients", "weights")
        self.averaged = list(averaged)
        self.rows = rows or (lambda x: (_num_rows(x),) * 2)
        self.forward = forward or (lambda n_real: contextlib.nullcontext())
        self.trainable, self.buffers, self.used, self._key = None, None, None, None
        self.current = None  # this step's ``GradBuffers`` (transient: None between steps)
        self.flat, self.optimizer_path = None, None  # the flat optimizer, or why not
        #: the rank's device, where the variables may still be in host memory (shard=
        #: "weights" builds the replica there: only the pieces come to the device); None:
        #: the variables'
        self.device = None

    def layout(self):
        """(Re)make the flat buffers when the trainable variables changed; True if so
        (then ``flat_layout.generation`` moved too: graphs recorded before are stale)."""
        trainable = self.model.trainable_weights[:]
        key = [id(v) for v in trainable]
        if self.buffers is not None and key == self._key:
            if self.zero is not None:  # the state a fit's end gathered: back into pieces
                self.zero.release()
            return False
        self.model.zero_grad(set_to_none=True)  # stale .grad from an eager step: free it
        tensors = [v.value for v in trainable] + [v.value for v in self.averaged]
        # sharded: the gradient heads padded to equal pieces, one per rank
        groups = None
        if self.shard == "weights":  # laid out as the weights: a buffer per layer
            groups = flat_layout.layer_groups(trainable) + [None] * len(self.averaged)
        # transient: a layout only, the memory comes with each step (``begin``)
        self.buffers = flat_layout.Buffers(tensors, self.world if self.shard else 1,
                                           lead=len(trainable), groups=groups,
                                           device=self.device, lazy=self.transient)
        self.current = GradBuffers.of(self.buffers)
        self.zero = None
        if self.shard:
            self.zero = zero.Shards(self.model.optimizer, trainable, self.rank, self.world,
                                    transient=self.transient,
                                    weights=self.shard == "weights", device=self.device)
            self.zero.grad_buffers(self.grads)
            stage = {"optimizer": "ZeRO-1", "gradients": "ZeRO-2: 1/N of the gradient kept",
                     "weights": "ZeRO-3: 1/N of the weights and the gradient kept"}[self.shard]
            self.optimizer_path = (f"kmgpu's flat {self.zero.flat.kind} update on this "
                                   f"rank's 1/{self.world} of the state ({stage})")
        else:
            self.optimizer_path = None
        if self.transient:  # made anew by each step (``begin``), freed by ``finish``
            self.buffers.drop()
            self.current = None
            self.zero.drop_grads()
        self.trainable, self._key, self.used = trainable, key, None
        self.flat = None
        return True

    @property
    def flats(self):
        return self.current.flats

    @property
    def grads(self):
        """The gradient parts of the buffers, one per dtype (the flat optimizer's order)."""
        return self.current.grads

    @property
    def stats(self):
        """The statistics parts of the buffers (after the gradients)."""
        return self.current.stats

    def begin(self):
        """Before stage A: with ``transient``, this step's whole gradient buffers, new
        (``by_layer``: the statistics' only; inside a CUDA graph capture they come from
        the graph's memory pool, at the address each replay writes; ``use`` puts a
        graph's back before its exchange)."""
        if self.transient:  # by layer: only the statistics' buffers (the gradient's
            # come one layer at a time within the backward pass)
            self.use(GradBuffers.fresh(self.buffers, grads=not self.by_layer))
        return self.current

    @property
    def by_layer(self):
        """shard="weights" with the gradient not all-reduced whole: each layer's gradient
        is reduce-scattered within the backward pass (``zero.Shards.scattered``)."""
        return self.zero is not None and self.zero.by_layer

    def use(self, buffers):
        """Make ``buffers`` (a ``GradBuffers``) the ones the exchange and stage B read."""
        self.current = buffers
        if self.zero is not None:
            self.zero.grad_buffers(buffers.grads)

    def forward_backward(self, x, y, sw, n_real, n_global):
        """Stage A: returns (loss, y_pred), both detached; the gradients are in ``flats``."""
        self.begin()
        model = self.model
        zero = self.zero
        # shard="weights": each layer's weights gathered where used, freed after, and
        # (``by_layer``) each layer's gradient reduce-scattered as soon as it is complete
        # (the hooks are set outside the gathering, which would gather on them)
        with zero.scattered() if zero is not None else contextlib.nullcontext(), \
                zero.active() if zero is not None else contextlib.nullcontext():
            with self.forward(n_real):
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            self._trim_heap()
            loss, part = self._loss(x, y, y_pred, sw, n_real, n_global)
            scaled = model.optimizer.scale_loss(part)
            grads = torch.autograd.grad(scaled, [v.value for v in self.trainable],
                                        allow_unused=True)
        self._trim_heap()
        share = n_real / n_global if self.world > 1 else 1.0  # BatchNorm statistics
        if self.used is None:
            self.used = [g is not None for g in grads]
        n = len(self.trainable)
        views = self.current.views
        with torch.no_grad():
            if not self.by_layer:  # (by layer: ``grads`` are stand-ins, the pieces written)
                _copy([views[i] for i in range(n) if grads[i] is not None],
                      [g for g in grads if g is not None])
                for i in range(n):
                    if grads[i] is None:
                        views[i].zero_()
            del grads
            for view, v in zip(views[n:], self.averaged):
                torch.mul(v.value, share, out=view)
        return loss.detach(), _map(step_fixes.detached, y_pred)  # masks kept: metrics read them

    def _trim_heap(self):
        """shard="weights" on a CPU device: the C heap's free pages given back after the
        forward pass and after the backward pass. Each pass allocates and frees layer-sized
        blocks (the collectives' scratch, autograd's gradients) between its smaller tensors
        that live on (the activations), so the freed blocks are split up and not reused:
        without this a rank's heap grows by about 11 bytes per parameter of free pages in
        the first step. On a GPU those blocks are device memory: nothing."""
        zero = self.zero
        if zero is not None and zero.gathering is not None and zero.gathering.host:
            heap.trim_heap()

    def _loss(self, x, y, y_pred, sw, n_real, n_global):
        """(what the loss tracker gets, with weight n_real; this replica's part of the
        global loss): the rule of ``kmgpu.engines.loss_fixes.replica_loss``."""
        from kmgpu.engines import loss_fixes as common

        if self.world == 1:  # one replica: Keras's own loss, whatever its reductions
            loss = step_fixes.compute_loss(self.model, x, y, y_pred, sw, training=True)
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
        views = self.current.views
        with torch.no_grad():
            for view, v in zip(views[n:], self.averaged):
                v.value.copy_(view)
            flat = self.flat_optimizer() if self.zero is None else None
            if self.zero is not None:
                if not all(self.used):
                    raise ValueError(
                        f"shard={self.shard!r}: some trainable variables get no gradient "
                        "(Keras's update skips them, a sharded update cannot): freeze them "
                        "(trainable=False) or pass shard=None.")
                self.zero.update()
            elif flat is not None:
                flat.step(self.grads)
            else:
                grads = [g if used else None for g, used in zip(views[:n], self.used)]
                if not model.optimizer.built:  # its variables exist before the branches run
                    model.optimizer.build(self.trainable)
                with cond_fixes.device_conditions(model.optimizer, self.trainable):
                    model.optimizer.apply(grads, self.trainable)
            if not n_real:  # a stand-in row: nothing of it counts
                return model.get_metrics_result()
            model._loss_tracker.update_state(loss, sample_weight=n_real)
            return model.compute_metrics(x, y, y_pred, sample_weight=sw)

    def flat_optimizer(self):
        """The ``flat_optim.FlatOptimizer`` stage B updates with (made at the first update,
        an eager step, before any capture: the variables and the optimizer's slots become
        views of flat buffers), or None: Keras's own ``optimizer.apply`` runs, and
        ``optimizer_path`` says why."""
        if self.optimizer_path is None:
            ok, why = flat_optim.supported(self.model.optimizer, self.trainable)
            if ok and not all(self.used):  # Keras leaves those alone: no decay, no slots
                ok, why = False, ("some trainable variables get no gradient (Keras's "
                                  "update skips them); Keras's own update runs")
            if ok and not flat_optim.enabled():
                ok, why = False, "KMGPU_TORCH_FLAT_OPTIMIZER=0: Keras's own update runs"
            if ok:
                self.flat = flat_optim.FlatOptimizer(self.model.optimizer, self.trainable)
                why = f"kmgpu's flat {self.flat.kind} update over one buffer per dtype"
                if self.flat.scaler is not None:
                    why += " (LossScaleOptimizer: a non-finite step skipped by one select)"
            self.optimizer_path = why
        return self.flat

    def exchange(self):
        """Between A and B (eager): the all-reduce, or with ``shard`` the
        reduce-scatter of the gradient (``by_layer``: none, A did it) and the
        all-reduce of the statistics."""
        if self.zero is not None:
            self.zero.exchange()
            if self.reduce is not None and self.stats:
                self.reduce(self.stats)
        elif self.reduce is not None:
            self.reduce(self.flats)

    def finish(self):
        """After B (eager): with ``shard``, the all-gather of the updated weights; with
        ``transient``, this step's buffers let go (a captured graph's stay in its memory
        pool, as its activations do)."""
        if self.zero is not None:
            self.zero.gather()
        if self.transient:
            self.current = None
            self.zero.drop_grads()

    def held_bytes(self):
        """Bytes of the memory this step's tensors hold now (between steps: what a rank
        keeps), by kind: "weights" (the flat weights, and with shard="weights" this
        rank's own pieces), "gradients" (the gradient buffers, or this rank's pieces),
        "optimizer" (the flat optimizer state, or this rank's pieces, and whatever the
        Keras slot variables hold); each storage once, a freed one 0."""
        seen = set()

        def size(ts):
            total = 0
            for t in ts:
                st = t.untyped_storage()
                if st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
            return total

        flat = self.zero.flat if self.zero is not None else self.flat
        if flat is None:
            return None
        weights = list(flat.params) + list(flat.weights.views)  # (a host copy included)
        grads = list(self.current.flats) if self.current is not None else []
        state = [v.value for slots in flat.keras_slots.values() for v in slots]
        if self.zero is not None:
            weights += [p.params for p in flat.pieces]
            grads += list(self.zero.grad_pieces or ())
            state += [t for p in flat.pieces for t in p.slots.values()]
        return {"weights": size(weights), "gradients": size(grads), "optimizer": size(state)}

    def flat_weights(self):
        """The flat weight buffers (empty before the flat optimizer exists)."""
        flat = self.zero.flat if self.zero is not None else self.flat
        return list(flat.params) if flat is not None else []

    def step(self, x, y, sw, n_real, n_global):
        """A, all-reduce, B, eagerly."""
        loss, y_pred = self.forward_backward(x, y, sw, n_real, n_global)
        self.exchange()
        logs = self.update(x, y, sw, loss, y_pred, n_real, n_global)
        self.finish()
        return logs


class GradBuffers:
    """One step's flat gradient buffers (laid out as a ``flat_layout.Buffers``): per
    dtype ``flats``, the ``grads`` (heads, the gradients) and ``stats`` (tails, the
    statistics averaged), and one view per tensor (``views``)."""

    def __init__(self, flats, views, heads, tails):
        self.flats, self.views = flats, views
        # the trainable variables' dtypes come first, in the flat optimizer's order
        self.grads = [h for h in heads if h.numel()]
        self.stats = [t for t in tails if t.numel()]

    @classmethod
    def of(cls, buffers):
        """The buffers' own memory."""
        return cls(buffers.flats, buffers.views, buffers.heads, buffers.tails)

    @classmethod
    def fresh(cls, buffers, grads=True):
        """New zeroed memory laid out as ``buffers`` (``grads`` False: only for the
        statistics; the gradient heads hold no memory, their views None)."""
        return cls(*buffers.fresh(heads=grads))


#: which update stage B runs for a model, in words (for ``describe()``)
optimizer_words = flat_optim.optimizer_words


def _map(fn, structure):
    """``keras.tree.map_structure`` that leaves None alone (a leaf on torch)."""
    return keras.tree.map_structure(lambda t: None if t is None else fn(t), structure)


def _num_rows(x):
    leaves = [t for t in keras.tree.flatten(x) if t is not None]
    return int(leaves[0].shape[0])

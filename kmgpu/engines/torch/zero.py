"""``shard_optimizer=True`` on torch (ZeRO stage 1) over the flat buffers of ``flat_optim``.

The split step (``split_step``) keeps the gradient in one flat buffer per dtype, padded
to N equal, 256-byte aligned pieces; rank r owns the contiguous piece r. Per step:

  A  forward/backward into the flat gradient buffers (as unsharded);
     ``exchange``: a reduce-scatter of each buffer (``torch.distributed.reduce_scatter_single``,
     NCCL and gloo both have it), so each rank gets the summed gradient of its piece only;
     with ``clipnorm`` / ``global_clipnorm`` an all-reduce instead (the norms need every
     element; the rank then reads its piece, a view); BatchNorm statistics all-reduced;
  B  ``update``: the optimizer's update (``flat_optim``'s arithmetic) on this rank's piece of
     the weights with this rank's piece of the optimizer state: the only state allocated
     while training (Adam: 8/N bytes per parameter instead of 8);
     ``gather``: an all-gather of the updated pieces into the whole flat weights, in place,
     then Keras's variable constraints on the whole weights.

The exchange and the gather stay outside the CUDA graphs (as the unsharded all-reduce);
B's update is captured. The Keras optimizer's own slot variables hold no memory while a
fit trains (an empty tensor); ``materialize`` gathers the state into them on rank 0 (a
collective at the same moment on every rank: at fit's validation, every epoch end, the
end of training, after ``train_on_batch`` and when a fit stops early; the other ranks
keep 1/N; under torchrun every process's own model gets it: all-gather), so the user's
model gets the whole optimizer state back,
``save`` / ``load_model`` work as unsharded, and a later call's state (loaded, or
broadcast from rank 0) is taken back into the pieces at the next step (``release``).

Only elementwise updates can be cut into pieces: Keras's SGD, Adam, AdamW, RMSprop,
Adagrad, Lion, Nadam and Adamax with their options (``flat_optim.COVERED``); anything else
(Adafactor's factored moments, Lamb's per-layer trust ratio, Muon, a subclass, gradient
accumulation) is refused by ``check`` before any work. ``mixed_float16``'s
LossScaleOptimizer around one of them is sharded: its finite check needs the whole
gradient, so the gradient is all-reduced, not reduce-scattered.
"""

import keras
import torch
import torch.distributed as dist

from kmgpu.engines.torch import flat_layout, flat_optim


def check(optimizer):
    """Raise ValueError (what to do instead) when ``optimizer`` cannot be sharded."""
    if optimizer is None:
        return
    ok, why = flat_optim.supported(flat_optim.scaler(optimizer)[1])
    if not ok:
        name = type(optimizer).__name__
        raise ValueError(
            f"shard_optimizer=True on torch shards an update that is elementwise over the "
            f"parameters: Keras's {', '.join(flat_optim.COVERED)}; this optimizer is not ({why}"
            f"). Use one of those, pass shard_optimizer=False, or the JAX backend "
            f"(KERAS_BACKEND=jax), which shards any optimizer's state. ({name})")


def _reduce_scatter(out, flat):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat)


def _all_gather(out, piece):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, piece)


class Shards:
    """This rank's piece of the optimizer (see the module).

    Args:
        optimizer: the Keras optimizer (built here if needed, as Keras's apply does).
        trainable: the trainable variables, the step's order.
        rank, world: this rank and the number of ranks.
    """

    def __init__(self, optimizer, trainable, rank, world):
        check(optimizer)
        self.rank, self.world = rank, world
        self.scaler, optimizer = flat_optim.scaler(optimizer)
        if self.scaler is not None and not self.scaler.built:  # as Keras's apply builds it
            with keras.name_scope(self.scaler.name, caller=self.scaler):
                self.scaler.build(trainable)
        # the weights and (for now) the slots become views of flat buffers padded to
        # ``world`` equal aligned pieces; the slots' pieces are copied out below
        self.flat = flat_optim.FlatOptimizer(optimizer, trainable, multiple=world)
        self.optimizer = optimizer
        # the whole gradient on every rank (all-reduce): the clipping norms, and the
        # loss scale's finite check, need every element
        self.whole = bool(optimizer.clipnorm or optimizer.global_clipnorm or self.scaler)
        self.parts = []  # per dtype group: (lo, hi) of this rank's piece
        for g in self.flat.groups:
            size = g.numel // world
            self.parts.append((rank * size, (rank + 1) * size))
        self.slots = [{} for _ in self.flat.groups]
        self._keras_slots = []  # per group: name -> [Keras slot variable per variable]
        index = optimizer._get_variable_index
        for g in self.flat.groups:
            attrs = {n: a for n, a, _ in flat_optim.SLOTS[self.flat.kind] + [flat_optim.EMA]}
            self._keras_slots.append({name: [getattr(optimizer, attrs[name])[index(v)]
                                             for v in g.variables] for name in g.slots})
        self.materialized = True  # the Keras slot variables hold the state now
        self.stepped = False  # a step ran since the last materialize (every rank alike)
        self.release()
        for g in self.flat.groups:
            g.slots = {}  # the whole slot buffers: freed (the pieces are in self.slots)
        self.grad_pieces = None
        self._decayed = [self._decayed_pieces(g, part) for g, part in
                         zip(self.flat.groups, self.parts)]
        self._spans = [self._piece_spans(g, part) for g, part in
                       zip(self.flat.groups, self.parts)]

    # -- the layout ---------------------------------------------------------------------
    def _overlaps(self, g, part):
        """(variable index, lo, hi) in buffer coordinates: the variables' elements in
        this rank's piece."""
        lo, hi = part
        out = []
        for i, (v, o) in enumerate(zip(g.variables, g.offsets)):
            a, b = max(o, lo), min(o + v.value.numel(), hi)
            if a < b:
                out.append((i, a, b))
        return out

    def _decayed_pieces(self, g, part):
        if g.decayed is None or g.decayed is True:
            return g.decayed
        decayed = {id(w) for w in g.decayed}
        lo = part[0]
        piece = g.params[part[0]:part[1]]
        return [piece[a - lo:b - lo] for i, a, b in self._overlaps(g, part)
                if id(g.views[i]) in decayed]

    def _piece_spans(self, g, part):
        """Each variable's span (elements + padding after) inside this rank's piece."""
        lo, hi = part
        ends = g.offsets[1:] + [g.numel]
        spans = [max(0, min(b, hi) - max(a, lo)) for a, b in zip(g.offsets, ends)]
        return torch.tensor(spans, device=g.params.device)

    def grad_buffers(self, flats):
        """Make this rank's gradient pieces for the step's flat gradient buffers (one per
        dtype group, laid out as the weights)."""
        self.grad_flats = list(flats)
        if self.whole:  # all-reduced whole: the piece is a view
            self.grad_pieces = [f[lo:hi] for f, (lo, hi) in zip(flats, self.parts)]
        else:
            self.grad_pieces = [f.new_zeros(hi - lo) for f, (lo, hi) in zip(flats, self.parts)]

    # -- one step -----------------------------------------------------------------------
    def exchange(self):
        """The summed gradient of this rank's piece (eager: outside any graph)."""
        for flat, piece in zip(self.grad_flats, self.grad_pieces):
            if self.whole:
                dist.all_reduce(flat)
            else:
                _reduce_scatter(piece, flat)

    @torch.no_grad()
    def update(self):
        """The optimizer's update of this rank's piece (capturable), then ``iterations``
        += 1: ``FlatOptimizer.step``'s arithmetic, restricted to the piece. Under a
        LossScaleOptimizer: as Keras's, the gradient unscaled, the step kept only when
        every gradient is finite (a device-side select, no host branch), the scale
        doubled after ``dynamic_growth_steps`` finite steps, halved after one that is not."""
        if self.scaler is None:
            return self._update(self.grad_pieces, self.grad_flats)
        flat = self.flat
        pieces = [g.params[lo:hi] for g, (lo, hi) in zip(flat.groups, self.parts)]
        state = pieces + [s for slots in self.slots for s in slots.values()]
        flat_optim.loss_scaled_step(
            self.scaler, self.optimizer, self.grad_flats, state,
            lambda scale: self._update([g / scale for g in self.grad_pieces],
                                       [f / scale for f in self.grad_flats]))

    def _update(self, grad_pieces, grad_flats):
        flat, opt = self.flat, self.optimizer
        grads = list(grad_pieces)
        if opt.loss_scale_factor is not None:
            grads = [g / opt.loss_scale_factor for g in grads]
            whole = [g / opt.loss_scale_factor for g in grad_flats] if self.whole else None
        else:
            whole = grad_flats
        grads = self.flat._clip(grads, whole, self._spans)
        pieces = [g.params[lo:hi] for g, (lo, hi) in zip(flat.groups, self.parts)]
        if opt.weight_decay is not None:
            lr = opt.learning_rate
            factor = 1 - opt.weight_decay * (lr.value if hasattr(lr, "value") else lr)
            for p, decayed in zip(pieces, self._decayed):
                if decayed is True:
                    p.mul_(factor)
                elif decayed:
                    torch._foreach_mul_(decayed, factor)
        lr = flat._scalar(opt.learning_rate)
        step = getattr(flat, "_" + flat.kind.lower())
        scalars = flat._scalars(lr)
        for g, p, grad, slots in zip(flat.groups, pieces, grads, self.slots):
            step(g, p, grad, slots, lr, scalars)
        if opt.use_ema:
            momentum = (flat.iterations != 0).to(flat.dtype) * opt.ema_momentum
            for p, slots in zip(pieces, self.slots):
                slots["ema"].copy_(momentum * slots["ema"] + (1 - momentum) * p)
            if opt.ema_overwrite_frequency:
                now = (flat.iterations + 1) % opt.ema_overwrite_frequency == 0
                for p, slots in zip(pieces, self.slots):
                    p.copy_(torch.where(now, slots["ema"], p))
        flat.iterations.add_(1)

    @torch.no_grad()
    def gather(self):
        """Every rank's updated piece into the whole weights (in place, eager), then
        Keras's variable constraints."""
        self.stepped = True
        for g, (lo, hi) in zip(self.flat.groups, self.parts):
            _all_gather(g.params, g.params[lo:hi])
        for g in self.flat.groups:
            for v, w in g.constrained:
                w.copy_(v.constraint(w))

    # -- the Keras optimizer's variables ------------------------------------------------
    @torch.no_grad()
    def materialize(self, everywhere=False):
        """Gather the optimizer state into the Keras slot variables (a collective: every
        rank, at the same point): on rank 0 only (what snapshots the state for the user's
        model; the other ranks keep 1/N), or on every rank (``everywhere``: each process
        has its own user model, torchrun). No-op where they hold it already."""
        if not self.stepped:  # nothing new since the last gather: the same on every rank
            return
        self.stepped = False
        mine = everywhere or self.rank == 0
        for g, slots, keras_slots in zip(self.flat.groups, self.slots, self._keras_slots):
            for name, piece in slots.items():
                whole = piece.new_empty(g.numel) if mine else None
                if everywhere:
                    _all_gather(whole, piece)
                else:
                    dist.gather(piece, list(whole.chunk(self.world)) if mine else None, dst=0)
                if mine:
                    for var, view in zip(keras_slots[name], g.split(whole)):
                        var.value.data = view
        self.materialized = mine

    @torch.no_grad()
    def receivable(self):
        """Before rank 0's state is broadcast (a call's start): the Keras slot variables
        made whole again where they are not (their values come from the broadcast); the
        next step takes this rank's piece from them."""
        if self.materialized:
            return
        for g, keras_slots in zip(self.flat.groups, self._keras_slots):
            for variables in keras_slots.values():
                whole = g.params.new_zeros(g.numel)
                for var, view in zip(variables, g.split(whole)):
                    var.value.data = view
        self.materialized = True

    @torch.no_grad()
    def release(self):
        """Take this rank's piece of the state from the Keras slot variables (they may
        have been loaded or broadcast since ``materialize``) and free their memory."""
        if not self.materialized:
            return
        for gi, g in enumerate(self.flat.groups):
            lo, hi = self.parts[gi]
            for name, keras_slots in self._keras_slots[gi].items():
                piece = self.slots[gi].get(name)
                if piece is None:
                    piece = self.slots[gi][name] = g.params.new_zeros(hi - lo)
                for i, a, b in self._overlaps(g, (lo, hi)):
                    o = g.offsets[i]
                    piece[a - lo:b - lo].copy_(keras_slots[i].value.reshape(-1)[a - o:b - o])
                for var in keras_slots:
                    var.value.data = var.value.new_empty(0)
        self.materialized = False

    def state_bytes(self):
        """(bytes of optimizer slots this rank holds while training, bytes unsharded)."""
        per = sum(p.numel() * p.element_size() for s in self.slots for p in s.values())
        whole = sum(g.numel * g.params.element_size() * len(s)
                    for g, s in zip(self.flat.groups, self.slots))
        return per, whole


class GatherBack(keras.callbacks.Callback):
    """In a sharded fit, on every rank: the whole optimizer state into rank 0's (or, with
    ``everywhere``, every rank's) Keras variables before fit's validation, at every epoch end and at the end of training
    (before rank 0 snapshots it); the next step takes the pieces back."""

    def __init__(self, split, everywhere=False):
        super().__init__()
        self.split, self.everywhere = split, everywhere

    def _gather(self, *args, **kwargs):
        if self.split.zero is not None:
            self.split.zero.materialize(self.everywhere)

    on_test_begin = on_epoch_end = on_train_end = _gather


def state_bytes(template, world):
    """For describe(): (optimizer-state bytes on each of ``world`` ranks with
    ``shard_optimizer``, whole bytes, bytes kept whole on every rank: the step count and
    other scalars), from the layout ``Shards`` makes (each variable 256-byte aligned, each
    dtype padded to ``world`` equal pieces); None when the optimizer is not built or not
    shardable."""
    from kmgpu.engines import replication

    opt = getattr(template, "optimizer", None)
    if opt is None or not opt.built:
        return None
    inner = flat_optim.scaler(opt)[1]
    if not flat_optim.supported(inner, template.trainable_weights)[0]:
        return None
    state = replication.optimizer_state(opt)
    whole = sum(v.value.numel() * v.value.element_size() for v in state)
    by_dtype = {}
    for v in template.trainable_weights:
        by_dtype.setdefault(v.value.dtype, []).append(v.value)
    slots = [s for s in flat_optim.SLOTS[flat_optim.kind(inner)] if s[2] is None or s[2](inner)]
    if flat_optim.EMA[2](inner):
        slots.append(flat_optim.EMA)
    sliced = sum(v.value.numel() * v.value.element_size() for v in template.trainable_weights)
    kept = whole - sliced * len(slots)
    per = kept + len(slots) * sum(flat_layout.offsets(ts, world)[1] // world * ts[0].element_size()
                                  for ts in by_dtype.values())
    return per, whole, kept


def describe(text, world, template):
    """``graphs.describe``'s words for ``template``'s step, made to say what a sharded
    step does."""
    what = (f"forward+backward into a flat gradient buffer, reduce-scatter (all-reduce with "
            f"clipnorm/global_clipnorm/mixed_float16), the optimizer on this rank's 1/{world} "
            f"of the state (ZeRO-1), all-gather of the weights, metrics")
    if text.startswith("Keras's eager step"):  # a CPU: the split step runs eagerly
        return f"split step ({what}), eager: CUDA graphs need GPUs"
    unsharded = ("forward+backward into a flat gradient buffer, one all-reduce, optimizer "
                 f"({flat_optim.optimizer_words(template)})+metrics")
    return text.replace(unsharded, what)

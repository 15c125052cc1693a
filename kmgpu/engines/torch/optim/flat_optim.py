"""Keras's optimizer update over flat buffers: one update for all variables.

Keras 3.15.1 on torch updates the trainable variables with ``torch._foreach_*`` ops over
Python lists of per-variable tensors (``TorchParallelOptimizer``), after a per-variable
Python loop for the weight decay, the clipping, EMA and the constraints. ``FlatOptimizer``
does the same arithmetic on ONE contiguous tensor per dtype (``flat_layout.Buffers``): the
trainable variables (their torch Parameters become views of it: ``param.data = view``, so
Keras, autograd and save/load see the same memory), the gradient laid out the same way,
and every slot variable of the Keras optimizer (also made views of a flat buffer, so
``optimizer.variables``, ``save``/``load`` stay right without copies). Each variable
starts ``ALIGN_BYTES`` into its buffer (zero padding between: every update leaves it 0),
so a gradient buffer must have the same layout: ``new_grads()`` / ``grad_views()``.

The update is elementwise, so it runs on a piece of the buffers (``Piece``): unsharded the
whole buffers (views, no copy: ``step``), under ``shard_optimizer`` (``zero``) this rank's
piece after a reduce-scatter, the weights all-gathered after it. Each optimizer's own
arithmetic is in ``flat_updates``. The optimizer's own ``iterations`` (and Nadam's
``u_product``) are used in place on the device, and the learning rate is read from
``optimizer.learning_rate`` each step (a variable, or the schedule called on the
iteration tensor): nothing is read back to the host, so ``update`` can be captured in a
CUDA graph (a schedule that branches on the host, e.g. ``ops.cond``, still cannot).

Covered (``supported``): SGD (momentum, Nesterov), Adam (amsgrad), AdamW, RMSprop
(momentum, centered), Adagrad, Lion, Nadam, Adamax, exactly as Keras's torch classes
compute them, with ``weight_decay`` and its exclusions (``exclude_from_weight_decay``),
``clipnorm`` / ``clipvalue`` / ``global_clipnorm``, ``loss_scale_factor`` (the gradient
unscaled first), ``use_ema`` (``ema_overwrite_frequency`` as a device-side select) and
variable constraints, and under a ``LossScaleOptimizer`` (``mixed_float16``) as Keras's:
the gradient unscaled, the step kept only where every gradient is finite (one select per
flat buffer on the device, no host branch: Keras's ``ops.cond`` selected each state
tensor, a kernel per tensor, ``cond_fixes``), the scale doubled after
``dynamic_growth_steps`` finite steps and halved after one that is not. Not covered
(Keras's own code stays): other optimizers and subclasses, ``gradient_accumulation_steps``,
variables with ``overwrite_with_gradient``.
"""

import keras
import torch

from kmgpu import environment
from kmgpu.engines.torch.optim import flat_layout, flat_updates

COVERED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion", "Nadam", "Adamax")
#: (slot, the Keras optimizer's attribute holding one variable per trainable variable, when)
SLOTS = {
    "SGD": [("momentum", "momentums", lambda o: o.momentum != 0)],
    "Adam": [("m", "_momentums", None), ("v", "_velocities", None),
             ("vhat", "_velocity_hats", lambda o: o.amsgrad)],
    "RMSprop": [("v", "_velocities", None), ("mom", "_momentums", lambda o: o.momentum > 0),
                ("avg", "_average_gradients", lambda o: o.centered)],
    "Adagrad": [("acc", "_accumulators", None)],
    "Lion": [("m", "_momentums", None)],
    "Nadam": [("m", "_momentums", None), ("v", "_velocities", None)],
    "Adamax": [("m", "_m", None), ("u", "_u", None)],
}
SLOTS["AdamW"] = SLOTS["Adam"]
EMA = ("ema", "_model_variables_moving_average", lambda o: o.use_ema)
#: where Adam's update runs as torch's fused kernel (``FlatOptimizer._fused``)
FUSED_DEVICES = ("cuda",)
_KINDS = None


def kind(optimizer):
    """'Adam', 'SGD', ... for Keras's own optimizer classes on torch; None for anything
    else (another optimizer, or a subclass: it may change the update)."""
    global _KINDS
    if _KINDS is None:  # the torch classes Keras makes (TorchOptimizer.__new__)
        _KINDS = {}
        for name in COVERED:
            cls = getattr(keras.optimizers, name)
            _KINDS[type(cls.__new__(cls))] = name
    return _KINDS.get(type(optimizer))


def scaler(optimizer):
    """(the LossScaleOptimizer of ``mixed_float16`` or None, the optimizer it wraps)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, optimizer.inner_optimizer
    return None, optimizer


def supported(optimizer, variables=None):
    """(True, None) when ``FlatOptimizer`` reproduces ``optimizer.apply`` for these
    variables; else (False, why: Keras's own optimizer code keeps running)."""
    if type(optimizer) is keras.optimizers.LossScaleOptimizer:  # Keras's own, not a subclass
        ok, why = supported(optimizer.inner_optimizer, variables)
        return ok, None if ok else f"LossScaleOptimizer's inner {why}"
    name = type(optimizer).__name__
    if kind(optimizer) is None:
        return False, (f"{name} is not one of Keras's {', '.join(COVERED)} (a subclass may "
                       "change the update); Keras's own update runs")
    if optimizer.gradient_accumulation_steps:
        return False, "gradient_accumulation_steps: Keras's own update runs"
    if variables is not None:
        variables = list(variables)
        if not variables:
            return False, "no trainable variables"
        for v in variables:
            if getattr(v, "overwrite_with_gradient", False):
                return False, (f"variable {v.path} is overwritten with its gradient "
                               "(float8): Keras's own update runs")
            if not torch.is_floating_point(v.value):
                return False, f"variable {v.path} is not floating point ({v.dtype})"
        if optimizer.use_ema and optimizer.built and (
                {id(v) for v in variables} != {id(v) for v in optimizer._trainable_variables}):
            return False, ("use_ema averages every variable the optimizer was built on; "
                           "these variables are not that set")
    return True, None


def enabled():
    """False when ``KMGPU_TORCH_FLAT_OPTIMIZER=0`` asks for Keras's own update (to measure)."""
    return environment.enabled("KMGPU_TORCH_FLAT_OPTIMIZER")


def optimizer_words(model):
    """Which update kmgpu's split step runs for ``model``, in words (for ``describe()``)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return "no optimizer"
    ok, why = supported(opt, model.trainable_weights)
    if ok and not enabled():
        ok, why = False, "KMGPU_TORCH_FLAT_OPTIMIZER=0: Keras's own update runs"
    return "kmgpu's flat update, one buffer per dtype" if ok else why


class Piece:
    """Elements ``lo:hi`` of one dtype's flat buffers: what one update writes.

    Attributes:
        params: the weights' elements (a view of the flat weights).
        slots: slot name -> the optimizer state of those elements (views of the whole
            state buffers; ZeRO: this rank's own tensors).
        decayed: weight decay: None (none), True (every element), or views of the
            decayed variables' elements.
        spans: each variable's span in the piece (clipnorm's expansion, a device tensor).
    """

    def __init__(self, lo, hi, params, slots, decayed, spans):
        self.lo, self.hi, self.params, self.slots = lo, hi, params, slots
        self.decayed, self.spans = decayed, spans


class FlatOptimizer:
    """``optimizer.apply(grads, variables)`` as flat-buffer ops (see the module), on this
    rank's piece of the buffers: ``world`` 1, the whole buffers (views, no copy); ZeRO
    (``zero``), piece ``rank`` of ``world`` equal pieces, its optimizer state a tensor of
    its own (zeros here: ``zero.Shards`` fills it from the Keras slot variables).

    Attributes:
        weights: the ``flat_layout.Buffers`` the variables are views of.
        pieces: the ``Piece`` this update writes, per weights buffer.
        keras_slots: slot name -> the Keras slot variable of each variable.
    """

    def __init__(self, optimizer, variables, rank=0, world=1, groups=None, device=None,
                 unfilled=False):
        ok, why = supported(optimizer, variables)
        if not ok:
            raise ValueError(f"kmgpu's flat optimizer does not cover this: {why}")
        variables = list(variables)
        if not optimizer.built:  # as Keras's apply builds it (the slots' paths)
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
        self.scaler, optimizer = scaler(optimizer)
        self.optimizer, self.kind = optimizer, kind(optimizer)
        missing = [v.path for v in variables
                   if id(v) not in optimizer._trainable_variables_indices]
        if missing:
            raise ValueError(f"the optimizer was built without these variables: {missing}")
        index = optimizer._get_variable_index
        wanted = [s for s in SLOTS[self.kind] if s[2] is None or s[2](optimizer)]
        if EMA[2](optimizer):
            wanted.append(EMA)
        self.variables = variables
        self.keras_slots = {name: [getattr(optimizer, attr)[index(v)] for v in variables]
                            for name, attr, _ in wanted}
        # ``groups``: one buffer per group and dtype (shard="weights": per layer)
        # ``unfilled``: the variables hold no memory yet (``optim.unfilled``): laid out,
        # not read; the pieces start at zero
        self.weights = flat_layout.Buffers([v.value for v in variables], world, adopt=True,
                                           groups=groups, lazy=unfilled)
        # the slots laid out as the weights (Keras makes each with its variable's dtype);
        # ZeRO keeps only this rank's piece of them
        self.state = None if world > 1 else {
            name: flat_layout.Buffers([s.value for s in slots], adopt=True, groups=groups)
            for name, slots in self.keras_slots.items()}
        self.dtype = variables[0].value.dtype  # Keras casts its scalars to the first one's
        # where the update runs (shard="weights": the variables may be on the host yet,
        # their pieces go to ``device``: ``own_pieces``)
        self.device = torch.device(device) if device is not None else variables[0].value.device
        self.iterations = optimizer.iterations.value  # updated in place, on the device
        self._consts = {}
        self._decayed = [optimizer.weight_decay is not None and optimizer._use_weight_decay(v)
                         for v in variables]
        self.pieces = [self._piece(k, rank, world, self._decayed)
                       for k in range(len(self.weights.flats))]
        self.constrained = [(v, w) for v, w in zip(variables, self.weights.views)
                            if v.constraint is not None]
        # under a LossScaleOptimizer: whether the last step was kept (the constraints)
        self.finite = (torch.ones((), dtype=torch.bool, device=self.device)
                       if self.scaler is not None and self.constrained else None)

    @classmethod
    def from_keras(cls, optimizer, variables):
        """The flat update of ``optimizer`` for ``variables`` (builds the optimizer if
        needed; the variables and the slots become views of flat buffers)."""
        return cls(optimizer, variables)

    def own_pieces(self):
        """The pieces' weights become tensors of their own on ``device`` (copies of their
        elements): shard="weights" frees the whole buffers, so the update cannot write
        into them."""
        for k, p in enumerate(self.pieces):
            params = p.params.to(self.device, copy=True)
            own = self._piece(k, 0, 1, self._decayed, params, p.lo, p.hi)
            p.params, p.decayed, p.slots, p.spans = own.params, own.decayed, own.slots, own.spans

    def _piece(self, k, rank, world, decayed, params=None, lo=None, hi=None):
        w = self.weights
        if params is None:
            size = w.flats[k].numel() // world
            lo, hi = rank * size, (rank + 1) * size
            params = w.flats[k][lo:hi]
        if self.state is None:
            slots = {name: params.new_zeros(hi - lo) for name in self.keras_slots}
        else:
            slots = {name: b.flats[k][lo:hi] for name, b in self.state.items()}
        flags = [decayed[i] for i in w.members[k]]
        if not any(flags) or all(flags):
            decay = True if any(flags) else None
        else:
            decay = [params[a - lo:b - lo] for i, a, b in w.overlaps(k, lo, hi) if decayed[i]]
        return Piece(lo, hi, params, slots, decay, w.spans(k, lo, hi).to(params.device))

    # -- the layout -------------------------------------------------------------------
    @property
    def params(self):
        """The flat parameter buffers, one per dtype."""
        return self.weights.flats

    def new_grads(self):
        """Zeroed flat gradient buffers laid out like ``params``."""
        return [torch.zeros_like(f) for f in self.weights.flats]

    def flatten_grads(self, grads):
        """Per-variable gradients (the order of ``variables``) as new flat buffers."""
        flats = self.new_grads()
        with torch.no_grad():
            for view, g in zip(self.grad_views(flats), grads):
                view.copy_(g)
        return flats

    def grad_views(self, flats):
        """Per-variable views (the order of ``variables``) of flat gradient buffers."""
        return self.weights.like(flats)

    # -- the update -------------------------------------------------------------------
    def _scalar(self, x):
        if isinstance(x, keras.Variable):
            x = x.value
        if torch.is_tensor(x):
            return x.to(self.dtype)
        return torch.tensor(x, dtype=self.dtype, device=self.device)

    def _fused(self, grads):
        """Adam's update runs as torch's fused kernel (``flat_updates.fused_adam``): Adam or
        AdamW without amsgrad, float32 pieces and gradients on one CUDA device, unless
        ``KMGPU_TORCH_FUSED_ADAM=0``. Off CUDA the ten passes stay: they round as Keras's
        own update does, bit for bit, where the fused kernel differs by float32 rounding
        (a CPU has no kernel launches to save)."""
        if (self.kind not in ("Adam", "AdamW") or self.optimizer.amsgrad
                or self.device.type not in FUSED_DEVICES):
            return False
        tensors = [p.params for p in self.pieces] + list(grads)
        return (all(t.dtype == torch.float32 and t.device == self.device for t in tensors)
                and hasattr(torch, "_fused_adam_")
                and environment.enabled("KMGPU_TORCH_FUSED_ADAM"))

    def _const(self, x):
        """A device constant, made once (the first, eager step): a CUDA graph capture
        refuses the host-to-device copy of a new one."""
        if x not in self._consts:
            self._consts[x] = torch.tensor(x, dtype=self.dtype, device=self.device)
        return self._consts[x]

    @torch.no_grad()
    def step(self, flat_grads):
        """One ``optimizer.apply`` on the whole buffers (``world`` 1): ``flat_grads`` are
        per dtype (the order of ``params``); they are not modified."""
        if torch.is_tensor(flat_grads):
            flat_grads = [flat_grads]
        self.update(list(flat_grads))
        self.constrain()

    @torch.no_grad()
    def update(self, grads, whole=None):
        """The update of ``pieces``, capturable (no host read), then ``iterations`` += 1;
        Keras's constraints come after, on the whole weights (``constrain``).

        Args:
            grads: the summed gradient of each piece.
            whole: the whole summed gradient buffers, when the pieces are not the whole:
                the clipping norms and the loss scale's finite check read every element
                (None: they read ``grads``).
        """
        if self.scaler is None:
            return self._update(grads, whole)
        # as Keras's LossScaleOptimizer, with no host branch: the step kept only where
        # every gradient is finite, by one select per state tensor; the scale doubled
        # after ``dynamic_growth_steps`` finite steps, halved after one that is not
        lso, inner = self.scaler, self.optimizer
        scale = lso.dynamic_scale.value
        checked = grads if whole is None else whole
        finite = torch.stack([torch.isfinite(g).all() for g in checked]).all()
        state = ([p.params for p in self.pieces] + [s for p in self.pieces
                                                    for s in p.slots.values()]
                 + [self.iterations])
        if self.kind == "Nadam":
            state.append(inner._u_product.value)
        before = [t.clone() for t in state]
        self._update([g / scale for g in grads],
                     None if whole is None else [g / scale for g in whole])
        for t, old in zip(state, before):
            t.copy_(torch.where(finite, t, old))
        counter = lso.step_counter.value
        grow = counter == lso.dynamic_growth_steps - 1
        scale.copy_(torch.where(finite, torch.where(grow, scale * 2.0, scale), scale * 0.5))
        counter.copy_(torch.where(finite & ~grow, counter + 1, torch.zeros_like(counter)))
        if self.finite is not None:
            self.finite.copy_(finite)

    def _update(self, grads, whole):
        opt = self.optimizer
        if opt.loss_scale_factor is not None:
            grads = [g / opt.loss_scale_factor for g in grads]
            whole = None if whole is None else [g / opt.loss_scale_factor for g in whole]
        grads = self._clip(grads, grads if whole is None else whole)
        if opt.weight_decay is not None:
            lr = opt.learning_rate
            factor = 1 - opt.weight_decay * (lr.value if isinstance(lr, keras.Variable)
                                             else lr)
            for p in self.pieces:
                if p.decayed is True:
                    p.params.mul_(factor)
                elif p.decayed:
                    torch._foreach_mul_(p.decayed, factor)
        lr = self._scalar(opt.learning_rate)
        update = flat_updates.UPDATES[self.kind]
        scalars = flat_updates.scalars(opt, self.kind, lr, self.iterations, self._const,
                                       self.dtype)
        if self._fused(grads):
            flat_updates.fused_adam(opt, [p.params for p in self.pieces], list(grads),
                                    [p.slots["m"] for p in self.pieces],
                                    [p.slots["v"] for p in self.pieces], scalars["alpha"],
                                    self._const(flat_updates.FUSED_STEP))
        else:
            for p, grad in zip(self.pieces, grads):
                update(opt, p.params, grad, p.slots, lr, scalars)
        if opt.use_ema:
            self._ema()
        self.iterations.add_(1)

    @torch.no_grad()
    def constrain(self):
        """Keras's variable constraints on the whole weights (under a LossScaleOptimizer:
        where the last step was kept, as Keras skips the whole apply)."""
        for v, w in self.constrained:
            new = v.constraint(w)
            w.copy_(new if self.finite is None else torch.where(self.finite, new, w))

    def _clip(self, grads, whole):
        """Keras's clipnorm / global_clipnorm / clipvalue on ``grads``, the pieces'
        gradients, with the norms from ``whole``, the whole buffers."""
        opt = self.optimizer
        if opt.clipnorm and opt.clipnorm > 0:
            out = []
            for k, (p, grad, full) in enumerate(zip(self.pieces, grads, whole)):
                # Keras: g * clipnorm / max(||g||, clipnorm) per variable (0 norm: 0)
                norms = torch.stack(torch._foreach_norm(self.weights.split(k, full)))
                den = torch.clamp(norms, min=opt.clipnorm)
                den = torch.repeat_interleave(den, p.spans, output_size=grad.numel())
                out.append(torch.mul(grad, opt.clipnorm) / den)
            return out
        if opt.global_clipnorm and opt.global_clipnorm > 0:
            clip = opt.global_clipnorm
            squares = torch.stack([torch.sum(torch.square(g)) for g in whole])
            use_norm = torch.sqrt(torch.sum(squares))
            scale = clip * torch.clamp(1.0 / use_norm, max=1.0 / clip)
            scale = scale + (use_norm - use_norm)  # inf / NaN norm: NaN, as Keras
            return [g * scale for g in grads]
        if opt.clipvalue and opt.clipvalue > 0:
            return [torch.clamp(g, -opt.clipvalue, opt.clipvalue) for g in grads]
        return grads


    def _ema(self):
        """Keras's moving average of every variable (momentum 0 at the first step), then
        every ``ema_overwrite_frequency`` steps the variables overwritten with it."""
        opt = self.optimizer
        momentum = (self.iterations != 0).to(self.dtype) * opt.ema_momentum
        for p in self.pieces:
            ema = p.slots["ema"]
            ema.copy_(momentum * ema + (1 - momentum) * p.params)
        if opt.ema_overwrite_frequency:
            now = (self.iterations + 1) % opt.ema_overwrite_frequency == 0
            for p in self.pieces:
                p.params.copy_(torch.where(now, p.slots["ema"], p.params))

    # -- Keras's variables -------------------------------------------------------------
    def write_back(self):
        """Make the Keras optimizer's variables hold the flat state (for save/load;
        ``world`` 1). The slots are views of the flat buffers and ``iterations`` is
        updated in place, so this only copies where someone replaced a variable's tensor
        since."""
        pairs = list(zip(self.variables, self.weights.like(self.weights.flats)))
        for name, slots in self.keras_slots.items():
            pairs += zip(slots, self.state[name].like(self.state[name].flats))
        with torch.no_grad():
            for v, view in pairs:
                if v.value.data_ptr() != view.data_ptr():
                    v.value.copy_(view)
            it = self.optimizer.iterations.value
            if it.data_ptr() != self.iterations.data_ptr():
                it.copy_(self.iterations)

"""Keras's optimizer update over flat buffers: one update for all variables.

Keras 3.15.1 on torch updates the trainable variables with ``torch._foreach_*`` ops over
Python lists of per-variable tensors (``TorchParallelOptimizer``), after a per-variable
Python loop for the weight decay, the clipping, EMA and the constraints. ``FlatOptimizer``
does the same arithmetic on ONE contiguous tensor per dtype: the trainable variables (their
torch Parameters become views of it: ``param.data = view``, so Keras, autograd and
save/load see the same memory), the gradient laid out the same way, and every slot variable
of the Keras optimizer (also made views of a flat buffer, so ``optimizer.variables``,
``save``/``load`` stay right without copies). Each variable starts ``ALIGN_BYTES`` into
its buffer (zero padding between: every update leaves it 0), so a gradient buffer must
have the same layout: ``new_grads()`` / ``grad_views()``. The optimizer's own ``iterations`` (and
Nadam's ``u_product``) are used in place on the device, and the learning rate is read from
``optimizer.learning_rate`` each step (a variable, or the schedule called on the
iteration tensor): nothing is read back to the host, so ``step`` can be captured in a CUDA
graph (a schedule that branches on the host, e.g. ``ops.cond``, still cannot).

Covered (``supported``): SGD (momentum, Nesterov), Adam (amsgrad), AdamW, RMSprop
(momentum, centered), Adagrad, Lion, Nadam, Adamax, exactly as Keras's torch classes
compute them, with ``weight_decay`` and its exclusions (``exclude_from_weight_decay``),
``clipnorm`` / ``clipvalue`` / ``global_clipnorm``, ``loss_scale_factor`` (the gradient
unscaled first), ``use_ema`` (``ema_overwrite_frequency`` as a device-side select) and
variable constraints, and under a ``LossScaleOptimizer`` (``mixed_float16``) as Keras's:
the gradient unscaled, the step kept only where every gradient is finite (one select per
flat buffer on the device, no host branch: Keras's ``ops.cond`` selected each state
tensor, a kernel per tensor, ``cond_keras_fixes``), the scale doubled after
``dynamic_growth_steps`` finite steps and halved after one that is not. Not covered
(Keras's own code stays): other optimizers and subclasses, ``gradient_accumulation_steps``,
variables with ``overwrite_with_gradient``.
"""

import os

import keras
import torch

from kmgpu.engines.torch.flat_layout import Group

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


def loss_scaled_step(lso, inner, checked, state, update):
    """``update(scale)`` (the inner optimizer's step on the gradients divided by
    ``scale``) as Keras's LossScaleOptimizer applies it, with no host branch: the step
    kept only where every tensor of ``checked`` (the scaled gradients) is finite, by one
    select per tensor of ``state`` (the parameters and slots it writes; the iteration
    count and Nadam's ``u_product`` are added here); the scale doubled after
    ``dynamic_growth_steps`` finite steps, halved after one that is not."""
    scale = lso.dynamic_scale.value
    finite = torch.stack([torch.isfinite(g).all() for g in checked]).all()
    state = list(state) + [inner.iterations.value]
    if kind(inner) == "Nadam":
        state.append(inner._u_product.value)
    before = [t.clone() for t in state]
    update(scale)
    for t, old in zip(state, before):
        t.copy_(torch.where(finite, t, old))
    counter = lso.step_counter.value
    grow = counter == lso.dynamic_growth_steps - 1
    scale.copy_(torch.where(finite, torch.where(grow, scale * 2.0, scale), scale * 0.5))
    counter.copy_(torch.where(finite & ~grow, counter + 1, torch.zeros_like(counter)))


def enabled():
    """False when ``KMGPU_TORCH_FLAT_OPTIMIZER=0`` asks for Keras's own update (to measure)."""
    return os.environ.get("KMGPU_TORCH_FLAT_OPTIMIZER", "1") != "0"


def optimizer_words(model):
    """Which update kmgpu's split step runs for ``model``, in words (for ``describe()``)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return "no optimizer"
    ok, why = supported(opt, model.trainable_weights)
    if ok and not enabled():
        ok, why = False, "KMGPU_TORCH_FLAT_OPTIMIZER=0: Keras's own update runs"
    return "kmgpu's flat update, one buffer per dtype" if ok else why


class FlatOptimizer:
    """``optimizer.apply(grads, variables)`` as flat-buffer ops (see the module)."""

    def __init__(self, optimizer, variables, multiple=1):
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
        by_dtype = {}
        for v in variables:
            by_dtype.setdefault(v.value.dtype, []).append(v)
        self.groups = []
        for vs in by_dtype.values():
            slots = {name: [getattr(optimizer, attr)[index(v)] for v in vs]
                     for name, attr, _ in wanted}
            decayed = [optimizer.weight_decay is not None and optimizer._use_weight_decay(v)
                       for v in vs]
            self.groups.append(Group(vs, slots, decayed, multiple))
        self.variables = [v for g in self.groups for v in g.variables]
        self.dtype = variables[0].value.dtype  # Keras casts its scalars to the first one's
        self.device = variables[0].value.device
        self.iterations = optimizer.iterations.value  # updated in place, on the device
        self._consts = {}

    @classmethod
    def from_keras(cls, optimizer, variables):
        """The flat update of ``optimizer`` for ``variables`` (builds the optimizer if
        needed; the variables and the slots become views of flat buffers)."""
        return cls(optimizer, variables)

    # -- the layout -------------------------------------------------------------------
    @property
    def params(self):
        """The flat parameter buffers, one per dtype (the order of ``groups``)."""
        return [g.params for g in self.groups]

    def new_grads(self):
        """Zeroed flat gradient buffers laid out like ``params``."""
        return [torch.zeros_like(g.params) for g in self.groups]

    def flatten_grads(self, grads):
        """Per-variable gradients (the order of ``variables``) as new flat buffers."""
        flats = self.new_grads()
        with torch.no_grad():
            for view, g in zip(self.grad_views(flats), grads):
                view.copy_(g)
        return flats

    def grad_views(self, flats):
        """Per-variable views (the order of ``variables``) of flat gradient buffers."""
        return [w for g, f in zip(self.groups, flats) for w in g.split(f)]

    # -- the update -------------------------------------------------------------------
    def _scalar(self, x):
        if isinstance(x, keras.Variable):
            x = x.value
        if torch.is_tensor(x):
            return x.to(self.dtype)
        return torch.tensor(x, dtype=self.dtype, device=self.device)

    def _const(self, x):
        """A device constant, made once (the first, eager step): a CUDA graph capture
        refuses the host-to-device copy of a new one."""
        if x not in self._consts:
            self._consts[x] = torch.tensor(x, dtype=self.dtype, device=self.device)
        return self._consts[x]

    @torch.no_grad()
    def step(self, flat_grads):
        """One ``optimizer.apply``: ``flat_grads`` are per dtype (the order of
        ``params``); they are not modified. Then ``iterations`` += 1 (under a
        LossScaleOptimizer: where every gradient is finite)."""
        if torch.is_tensor(flat_grads):
            flat_grads = [flat_grads]
        if self.scaler is None:
            return self._step(list(flat_grads))
        state = ([g.params for g in self.groups]
                 + [s for g in self.groups for s in g.slots.values()])
        loss_scaled_step(self.scaler, self.optimizer, flat_grads, state,
                         lambda scale: self._step([g / scale for g in flat_grads]))

    def _step(self, grads):
        opt = self.optimizer
        if opt.loss_scale_factor is not None:
            grads = [g / opt.loss_scale_factor for g in grads]
        grads = self._clip(grads)
        if opt.weight_decay is not None:
            lr = opt.learning_rate
            factor = 1 - opt.weight_decay * (lr.value if isinstance(lr, keras.Variable)
                                             else lr)
            for g in self.groups:
                if g.decayed is True:
                    g.params.mul_(factor)
                elif g.decayed:
                    torch._foreach_mul_(g.decayed, factor)
        lr = self._scalar(opt.learning_rate)
        update = getattr(self, "_" + self.kind.lower())
        scalars = self._scalars(lr)
        for g, grad in zip(self.groups, grads):
            update(g, g.params, grad, g.slots, lr, scalars)
        if opt.use_ema:
            self._ema()
        for g in self.groups:
            for v, w in g.constrained:
                w.copy_(v.constraint(w))
        self.iterations.add_(1)

    def _clip(self, grads, whole=None, spans=None):
        """Keras's clipnorm / global_clipnorm / clipvalue on ``grads``, one per group:
        the flat buffers, or (``zero``) each buffer's piece; then ``whole`` are the
        whole buffers the norms come from and ``spans`` each variable's elements in
        the piece."""
        opt = self.optimizer
        whole = grads if whole is None else whole
        spans = [g.spans for g in self.groups] if spans is None else spans
        if opt.clipnorm and opt.clipnorm > 0:
            out = []
            for g, grad, full, span in zip(self.groups, grads, whole, spans):
                # Keras: g * clipnorm / max(||g||, clipnorm) per variable (0 norm: 0)
                norms = torch.stack(torch._foreach_norm(g.split(full)))
                den = torch.clamp(norms, min=opt.clipnorm)
                den = torch.repeat_interleave(den, span, output_size=grad.numel())
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

    def _scalars(self, lr):
        """The per-step scalars of the update, as Keras's torch classes compute them."""
        opt, k = self.optimizer, self.kind
        if k in ("Adam", "AdamW", "Adamax", "Nadam"):
            step = (self.iterations + 1).to(self.dtype)
            b1_power = torch.pow(self._const(opt.beta_1), step)
        if k in ("Adam", "AdamW"):
            b2_power = torch.pow(self._const(opt.beta_2), step)
            return {"alpha": lr * torch.sqrt(1 - b2_power) / (1 - b1_power)}
        if k == "Adamax":
            return {"b1_power": b1_power}
        if k == "Nadam":
            next_step = (self.iterations + 2).to(self.dtype)
            decay, beta_1 = self._const(0.96), self._const(opt.beta_1)
            u_t = beta_1 * (1.0 - 0.5 * torch.pow(decay, step))
            u_t_1 = beta_1 * (1.0 - 0.5 * torch.pow(decay, next_step))
            u_product = opt._u_product.value
            u_product_t = u_product * u_t
            u_product_t_1 = u_product_t * u_t_1
            b2_power = torch.pow(self._const(opt.beta_2), step)
            u_product.copy_(u_product_t)
            return {"u_t": u_t, "u_t_1": u_t_1, "u_product_t": u_product_t,
                    "u_product_t_1": u_product_t_1, "b2_power": b2_power}
        return {}

    # one method per optimizer: the arithmetic of Keras's torch class, on flat tensors
    def _sgd(self, group, p, g, s, lr, sc):
        opt = self.optimizer
        if opt.momentum != 0:
            m = s["momentum"]
            m.mul_(opt.momentum)
            m.sub_(g * lr)
            if opt.nesterov:
                p.sub_(g * lr)
                p.add_(m, alpha=opt.momentum)
            else:
                p.add_(m)
        else:
            p.sub_(g * lr)

    def _moments(self, s, g):
        """Adam's and Nadam's moving first and second moments, in place: (m, v)."""
        opt = self.optimizer
        m, v = s["m"], s["v"]
        m.mul_(opt.beta_1)
        m.add_(g, alpha=1 - opt.beta_1)
        v.mul_(opt.beta_2)
        v.add_(g * g, alpha=1 - opt.beta_2)
        return m, v

    def _adam(self, group, p, g, s, lr, sc):
        opt = self.optimizer
        m, v = self._moments(s, g)
        if opt.amsgrad:
            torch.maximum(s["vhat"], v, out=s["vhat"])
            v = s["vhat"]
        p.sub_((m * sc["alpha"]) / (torch.sqrt(v) + opt.epsilon))

    _adamw = _adam

    def _rmsprop(self, group, p, g, s, lr, sc):
        opt = self.optimizer
        rho, v = opt.rho, s["v"]
        v.mul_(rho)
        v.add_(g * g, alpha=1 - rho)
        den = v + opt.epsilon
        if opt.centered:
            avg = s["avg"]
            avg.mul_(rho)
            avg.add_(g, alpha=1 - rho)
            den.sub_(avg * avg)
        den.sqrt_()
        increment = (g * lr) / den
        if opt.momentum > 0:
            mom = s["mom"]
            mom.mul_(opt.momentum)
            mom.add_(increment)
            p.sub_(mom)
        else:
            p.sub_(increment)

    def _adagrad(self, group, p, g, s, lr, sc):
        acc = s["acc"]
        acc.add_(g * g)
        p.sub_((g * lr) / torch.sqrt(acc + self.optimizer.epsilon))

    def _lion(self, group, p, g, s, lr, sc):
        opt, m = self.optimizer, s["m"]
        c = m * opt.beta_1
        c.add_(g, alpha=1 - opt.beta_1)
        p.sub_(torch.sign(c) * lr)
        m.mul_(opt.beta_2)
        m.add_(g, alpha=1 - opt.beta_2)

    def _nadam(self, group, p, g, s, lr, sc):
        opt = self.optimizer
        m, v = self._moments(s, g)
        m_hat = ((m * sc["u_t_1"]) / (1 - sc["u_product_t_1"])
                 + (g * (1 - sc["u_t"])) / (1 - sc["u_product_t"]))
        v_hat = v / (1 - sc["b2_power"])
        p.sub_((m_hat * lr) / (torch.sqrt(v_hat) + opt.epsilon))

    def _adamax(self, group, p, g, s, lr, sc):
        opt = self.optimizer
        m, u = s["m"], s["u"]
        m.mul_(opt.beta_1)
        m.add_(g, alpha=1 - opt.beta_1)
        u.mul_(opt.beta_2)
        torch.maximum(u, torch.abs(g), out=u)
        p.sub_((m * lr) / ((u + opt.epsilon) * (1 - sc["b1_power"])))

    def _ema(self):
        """Keras's moving average of every variable (momentum 0 at the first step), then
        every ``ema_overwrite_frequency`` steps the variables overwritten with it."""
        opt = self.optimizer
        momentum = (self.iterations != 0).to(self.dtype) * opt.ema_momentum
        for g in self.groups:
            ema = g.slots["ema"]
            ema.copy_(momentum * ema + (1 - momentum) * g.params)
        if opt.ema_overwrite_frequency:
            now = (self.iterations + 1) % opt.ema_overwrite_frequency == 0
            for g in self.groups:
                g.params.copy_(torch.where(now, g.slots["ema"], g.params))

    # -- Keras's variables -------------------------------------------------------------
    def write_back(self):
        """Make the Keras optimizer's variables hold the flat state (for save/load). The
        slots are views of the flat buffers and ``iterations`` is updated in place, so
        this only copies where someone replaced a variable's tensor since."""
        opt, index = self.optimizer, self.optimizer._get_variable_index
        with torch.no_grad():
            for g in self.groups:
                for name, flat in g.slots.items():
                    attr = next(a for n, a, _ in SLOTS[self.kind] + [EMA] if n == name)
                    for v, view in zip(g.variables, g.split(flat)):
                        t = getattr(opt, attr)[index(v)].value
                        if t.data_ptr() != view.data_ptr():
                            t.copy_(view)
                for v, view in zip(g.variables, g.split(g.params)):
                    if v.value.data_ptr() != view.data_ptr():
                        v.value.copy_(view)
            it = opt.iterations.value
            if it.data_ptr() != self.iterations.data_ptr():
                it.copy_(self.iterations)

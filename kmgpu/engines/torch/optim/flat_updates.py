"""Each covered Keras optimizer's update on flat tensors, for ``flat_optim``.

One function per Keras 3.15.1 torch optimizer class, with that class's arithmetic, in
place on ``p`` (the weights' elements of one piece of a flat buffer), ``g`` (their
gradient) and ``s`` (slot name -> the optimizer state of those elements); ``lr`` is the
learning rate and ``sc`` the step's scalars (``scalars``), device tensors. The functions
are elementwise, so any piece of the buffers can be updated on its own (``zero``).
"""

import torch


def scalars(opt, kind, lr, iterations, const, dtype):
    """The per-step scalars of the update, as Keras's torch classes compute them, from the
    ``iterations`` tensor; ``const(x)`` is a device constant. Nadam's ``u_product`` is
    updated in place here."""
    if kind in ("Adam", "AdamW", "Adamax", "Nadam"):
        step = (iterations + 1).to(dtype)
        b1_power = torch.pow(const(opt.beta_1), step)
    if kind in ("Adam", "AdamW"):
        b2_power = torch.pow(const(opt.beta_2), step)
        return {"alpha": lr * torch.sqrt(1 - b2_power) / (1 - b1_power)}
    if kind == "Adamax":
        return {"b1_power": b1_power}
    if kind == "Nadam":
        next_step = (iterations + 2).to(dtype)
        decay, beta_1 = const(0.96), const(opt.beta_1)
        u_t = beta_1 * (1.0 - 0.5 * torch.pow(decay, step))
        u_t_1 = beta_1 * (1.0 - 0.5 * torch.pow(decay, next_step))
        u_product = opt._u_product.value
        u_product_t = u_product * u_t
        u_product_t_1 = u_product_t * u_t_1
        b2_power = torch.pow(const(opt.beta_2), step)
        u_product.copy_(u_product_t)
        return {"u_t": u_t, "u_t_1": u_t_1, "u_product_t": u_product_t,
                "u_product_t_1": u_product_t_1, "b2_power": b2_power}
    return {}


def sgd(opt, p, g, s, lr, sc):
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


def _moments(opt, s, g):
    """Adam's and Nadam's moving first and second moments, in place: (m, v)."""
    m, v = s["m"], s["v"]
    m.mul_(opt.beta_1)
    m.add_(g, alpha=1 - opt.beta_1)
    v.mul_(opt.beta_2)
    v.add_(g * g, alpha=1 - opt.beta_2)
    return m, v


def adam(opt, p, g, s, lr, sc):
    m, v = _moments(opt, s, g)
    if opt.amsgrad:
        torch.maximum(s["vhat"], v, out=s["vhat"])
        v = s["vhat"]
    p.sub_((m * sc["alpha"]) / (torch.sqrt(v) + opt.epsilon))


#: the step count given torch's fused Adam: its bias corrections 1 - beta ** step are then
#: exactly 1, so that it computes Keras's update with Keras's own ``alpha`` as its rate
FUSED_STEP = 2.0 ** 30


def fused_adam(opt, params, grads, m, v, alpha, step):
    """``adam`` (not amsgrad) over every piece at once, in one ``torch._fused_adam_``
    launch (one kernel over the lists on CUDA, where ``adam`` is ten passes over the
    buffers): the moments as Keras's, then ``p -= alpha * m / (sqrt(v) + epsilon)`` with
    ``alpha`` (a device tensor: capturable) as the rate and bias corrections of 1
    (``step``: ``FUSED_STEP``, one device tensor for every piece). Equal to ``adam`` to
    float32 rounding (``tests/torch/test_flat_optim.py``)."""
    torch._fused_adam_(params, grads, m, v, [], [step] * len(params), lr=alpha,
                       beta1=opt.beta_1, beta2=opt.beta_2, weight_decay=0.0,
                       eps=opt.epsilon, amsgrad=False, maximize=False)


def rmsprop(opt, p, g, s, lr, sc):
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


def adagrad(opt, p, g, s, lr, sc):
    acc = s["acc"]
    acc.add_(g * g)
    p.sub_((g * lr) / torch.sqrt(acc + opt.epsilon))


def lion(opt, p, g, s, lr, sc):
    m = s["m"]
    c = m * opt.beta_1
    c.add_(g, alpha=1 - opt.beta_1)
    p.sub_(torch.sign(c) * lr)
    m.mul_(opt.beta_2)
    m.add_(g, alpha=1 - opt.beta_2)


def nadam(opt, p, g, s, lr, sc):
    m, v = _moments(opt, s, g)
    m_hat = ((m * sc["u_t_1"]) / (1 - sc["u_product_t_1"])
             + (g * (1 - sc["u_t"])) / (1 - sc["u_product_t"]))
    v_hat = v / (1 - sc["b2_power"])
    p.sub_((m_hat * lr) / (torch.sqrt(v_hat) + opt.epsilon))


def adamax(opt, p, g, s, lr, sc):
    m, u = s["m"], s["u"]
    m.mul_(opt.beta_1)
    m.add_(g, alpha=1 - opt.beta_1)
    u.mul_(opt.beta_2)
    torch.maximum(u, torch.abs(g), out=u)
    p.sub_((m * lr) / ((u + opt.epsilon) * (1 - sc["b1_power"])))


#: Keras's class name -> its update
UPDATES = {"SGD": sgd, "Adam": adam, "AdamW": adam, "RMSprop": rmsprop, "Adagrad": adagrad,
           "Lion": lion, "Nadam": nadam, "Adamax": adamax}

"""kmgpu's flat-buffer optimizer update (engines/torch/optim/flat_optim.py) against Keras's own.

For every covered optimizer and option: the same variables and gradients, 3 steps of
Keras's ``optimizer.apply`` and 3 of ``FlatOptimizer.step`` on the flat buffers; the
variables, every slot variable and ``iterations`` must be equal to float32 rounding.
The cases it does not cover must say why. Tiny tensors on a CPU; no fit.
"""

import re

import keras
import numpy as np
import pytest

from kmgpu.engines.torch.optim import flat_layout, flat_optim

TOL = 1e-6
SHAPES = {"dense/kernel": (3, 4), "dense/bias": (4,), "norm/gamma": (2, 3, 2), "norm/beta": (5,)}
O = keras.optimizers


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.standard_normal(s).astype("float32"), name=n.split("/")[1])
            for n, s in SHAPES.items()]


def _grads(step):
    import torch

    rng = np.random.default_rng(100 + step)
    # step 1: a zero gradient for one variable (clipnorm's 0-norm branch)
    return [torch.zeros(s) if step == 1 and i == 1 else
            torch.as_tensor(rng.standard_normal(s).astype("float32") * (i + 1))
            for i, s in enumerate(SHAPES.values())]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-6))


def _compare(make, steps=3, prepare=None):
    """(worst relative difference of the variables, of the optimizer's variables)."""
    ref_vars, flat_vars = _variables(), _variables()
    ref, mine = make(), make()
    if prepare:
        prepare(ref, ref_vars)
        prepare(mine, flat_vars)
    flat = flat_optim.FlatOptimizer.from_keras(mine, flat_vars)
    assert flat.variables == flat_vars
    for step in range(steps):
        grads = _grads(step)
        ref.apply([g.clone() for g in grads], ref_vars)
        before = [g.clone() for g in grads]
        flat.step(flat.flatten_grads(grads))
        assert all((g == b).all() for g, b in zip(grads, before))  # not modified
    flat.write_back()
    # the same slots under the same paths (less the automatic names' counters: adam,
    # adam_1; Nadam's unnamed u_product: variable, variable_1)
    def paths(opt):
        return [re.sub(r"_\d+$", "", v.path.replace(opt.name, "")) for v in opt.variables]

    assert paths(ref) == paths(mine)
    worst_vars = max(_rel(a.numpy(), b.numpy()) for a, b in zip(ref_vars, flat_vars))
    worst_slots = max(_rel(a.numpy(), b.numpy()) for a, b in zip(ref.variables, mine.variables))
    assert int(mine.iterations.numpy()) == int(ref.iterations.numpy()) == steps
    moved = max(_rel(a.numpy(), b.numpy()) for a, b in zip(_variables(), ref_vars))
    assert moved > 1e-4  # the reference did train
    return worst_vars, worst_slots


def _schedule():
    return O.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)


CASES = {
    "sgd": lambda: O.SGD(0.1),
    "sgd_momentum": lambda: O.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(0.01),
    "adam_amsgrad": lambda: O.Adam(0.01, amsgrad=True),
    "adamw": lambda: O.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: O.RMSprop(0.01),
    "rmsprop_momentum_centered": lambda: O.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: O.Adagrad(0.1),
    "lion": lambda: O.Lion(0.01),
    "nadam": lambda: O.Nadam(0.01),
    "adamax": lambda: O.Adamax(0.01),
    "weight_decay": lambda: O.SGD(0.1, momentum=0.9, weight_decay=0.05),
    "clipnorm": lambda: O.Adam(0.01, clipnorm=0.5),
    "clipvalue": lambda: O.RMSprop(0.01, clipvalue=0.3),
    "global_clipnorm": lambda: O.SGD(0.1, global_clipnorm=1.0),
    "schedule": lambda: O.Adam(_schedule()),
    "schedule_weight_decay": lambda: O.AdamW(_schedule(), weight_decay=0.2),
    "ema": lambda: O.Adam(0.01, use_ema=True, ema_momentum=0.9),
    "ema_overwrite": lambda: O.SGD(0.1, use_ema=True, ema_momentum=0.8,
                                   ema_overwrite_frequency=2),
    "loss_scale_factor": lambda: O.Adam(0.01, loss_scale_factor=128.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flat_update_equals_keras(name):
    worst_vars, worst_slots = _compare(CASES[name])
    assert worst_vars <= TOL and worst_slots <= TOL, (worst_vars, worst_slots)


@pytest.mark.parametrize("name", ["adam", "adamw", "schedule_weight_decay", "clipnorm",
                                  "ema", "loss_scale_factor"])
def test_fused_adam_equals_keras(name, monkeypatch):
    """Adam's update as torch's fused kernel (on CUDA by default; here its CPU kernel):
    one call per step, equal to Keras's update to float32 rounding."""
    from kmgpu.engines.torch.optim import flat_updates

    calls = []
    fused = flat_updates.fused_adam
    monkeypatch.setattr(flat_optim, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(flat_updates, "fused_adam",
                        lambda *a: (calls.append(1), fused(*a))[1])
    worst_vars, worst_slots = _compare(CASES[name])
    assert len(calls) == 3  # one per step
    assert worst_vars <= TOL and worst_slots <= TOL, (worst_vars, worst_slots)


def test_weight_decay_exclusions():
    def exclude(opt, variables):
        opt.exclude_from_weight_decay(var_list=[variables[1]], var_names=["gamma"])

    worst = _compare(lambda: O.AdamW(0.01, weight_decay=0.5), prepare=exclude)
    assert max(worst) <= TOL, worst


def test_constraints_and_variables_are_views():
    import torch

    ref_vars, flat_vars = _variables(), _variables()
    for vs in (ref_vars, flat_vars):
        vs[0].constraint = keras.constraints.MaxNorm(0.5)
    ref, mine = O.Adam(0.1), O.Adam(0.1)
    flat = flat_optim.FlatOptimizer.from_keras(mine, flat_vars)
    # every variable and slot is a view of one flat buffer per dtype
    (params,) = flat.params
    span = flat_layout.ALIGN_BYTES // 4  # every variable at an aligned offset
    assert params.numel() == sum(-(-int(np.prod(s)) // span) * span for s in SHAPES.values())
    offsets = [v.value.data_ptr() - params.data_ptr() for v in flat_vars]
    assert offsets == [0, span * 4, 2 * span * 4, 3 * span * 4]
    for step in range(3):
        grads = _grads(step)
        ref.apply(grads, ref_vars)
        flat.step(flat.flatten_grads(grads))
    assert max(_rel(a.numpy(), b.numpy()) for a, b in zip(ref_vars, flat_vars)) <= TOL
    assert float(torch.linalg.vector_norm(flat_vars[0].value.detach(), dim=0).max()) <= 0.5 + 1e-6
    # what Keras assigns (load, set_weights) lands in the flat buffer
    flat_vars[1].assign(np.full((4,), 7.0, "float32"))
    assert float(params[span:span + 4].sum()) == 28.0
    assert float(params[span + 4:2 * span].abs().sum()) == 0.0  # the padding stays 0


def test_step_is_capture_safe_on_cpu_no_host_reads():
    """The iteration and Nadam's u_product stay device tensors updated in place."""
    vs = _variables()
    opt = O.Nadam(0.01)
    flat = flat_optim.FlatOptimizer.from_keras(opt, vs)
    it, u = opt.iterations.value, opt._u_product.value
    flat.step(flat.flatten_grads(_grads(0)))
    assert opt.iterations.value is it and int(it) == 1
    assert opt._u_product.value is u and float(u.detach()) != 1.0


@pytest.mark.parametrize("inner", ["adam", "nadam", "sgd_momentum", "ema_overwrite"])
def test_loss_scale_optimizer_equals_keras(inner):
    """mixed_float16's LossScaleOptimizer: gradients unscaled, a step with an inf gradient
    skipped (nothing moves but the scale, halved, and the counter, reset), the scale
    doubled after ``dynamic_growth_steps`` finite steps; no host read in between."""
    import torch

    ref_vars, flat_vars = _variables(), _variables()
    ref = O.LossScaleOptimizer(CASES[inner](), initial_scale=64.0, dynamic_growth_steps=2)
    mine = O.LossScaleOptimizer(CASES[inner](), initial_scale=64.0, dynamic_growth_steps=2)
    flat = flat_optim.FlatOptimizer.from_keras(mine, flat_vars)
    scales = []
    for step in range(6):
        grads = [g * 64.0 for g in _grads(step)]
        if step == 2:
            grads[3][1] = float("inf")
        if step == 4:
            grads[0][0, 0] = float("nan")
        ref.apply([g.clone() for g in grads], ref_vars)
        flat.step(flat.flatten_grads(grads))
        assert torch.is_tensor(mine.dynamic_scale.value)
        scales.append((float(ref.dynamic_scale.numpy()), float(mine.dynamic_scale.numpy())))
    flat.write_back()
    assert [a for a, _ in scales] == [b for _, b in scales] == [64, 128, 64, 64, 32, 32]
    assert int(mine.iterations.numpy()) == int(ref.iterations.numpy()) == 4  # 2 skipped
    assert int(mine.step_counter.numpy()) == int(ref.step_counter.numpy())
    for a, b in zip(ref_vars, flat_vars):
        assert _rel(a.numpy(), b.numpy()) <= TOL, a.name
    for a, b in zip(ref.variables, mine.variables):
        assert _rel(a.numpy(), b.numpy()) <= TOL, a.path
    assert all(np.isfinite(v.numpy()).all() for v in flat_vars)


@pytest.mark.parametrize("make, reason", [
    (lambda: O.LossScaleOptimizer(O.Adadelta()), "LossScaleOptimizer's inner Adadelta"),
    (lambda: O.Adadelta(), "Adadelta is not one of"),
    (lambda: O.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
    (lambda: type("MyAdam", (O.Adam,), {})(), "MyAdam is not one of"),
])
def test_unsupported_say_why(make, reason):
    ok, why = flat_optim.supported(make(), _variables())
    assert not ok and reason in why
    with pytest.raises(ValueError, match="does not cover"):
        flat_optim.FlatOptimizer.from_keras(make(), _variables())


def test_unsupported_variables_say_why():
    vs = _variables()
    vs[2].overwrite_with_gradient = True
    ok, why = flat_optim.supported(O.Adam(), vs)
    assert not ok and "overwritten with its gradient" in why
    ok, why = flat_optim.supported(O.SGD(), _variables() + [keras.Variable(np.arange(3), trainable=False)])
    assert not ok and "not floating point" in why
    opt = O.Adam(use_ema=True)
    vs = _variables()
    opt.build(vs)
    ok, why = flat_optim.supported(opt, vs[:2])
    assert not ok and "use_ema" in why
    assert flat_optim.supported(O.Adam(), _variables()) == (True, None)

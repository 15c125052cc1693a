"""kmgpu's flat-buffer optimizer (``flat_optim``) inside the split train step.

compile(jit_compile=True) runs the split step on a CPU (the same stages the GPU captures);
its stage B updates with ``FlatOptimizer`` over the flat gradient buffer (views, no
copy) for the optimizers it covers. The weights and the optimizer's own variables
must equal Keras's own fit: on one device and on 2 gloo ranks. An optimizer it does
not cover keeps Keras's update, and describe() says which one runs.
"""

from contextlib import nullcontext

import keras
import torch

import kmgpu
from tests.helpers import conv_bn, data, few_steps, mlp, one_device, rel_diff

TOL = 1e-6


def _adamw():
    opt = keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=3, decay_rate=0.7),
        weight_decay=0.05, clipnorm=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


def _fit(build, make_opt, x, gpus):
    model = build()
    with one_device() if gpus == 1 else nullcontext():
        runner = model if gpus is None else kmgpu.parallelize(model, gpus=gpus)
    runner.compile(optimizer=make_opt(), loss="mse", jit_compile=gpus is not None)
    torch.manual_seed(7)  # the shuffle draws from it (engines/torch/data/shuffle.py)
    y = x[1]
    with few_steps() if gpus is not None else nullcontext():
        runner.fit(x[0], y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    return model, runner


def _optimizer_state(model):
    return [v.numpy() for v in model.optimizer.variables]


def test_one_device_flat_update_equals_kerass_apply():
    """AdamW (schedule, exclusions, clipnorm) on a conv+BN net, 97 rows (a partial batch)."""
    x = data("conv_bn", 97)
    ref, _ = _fit(conv_bn, _adamw, x, None)
    model, parallel = _fit(conv_bn, _adamw, x, 1)
    split = parallel._engine._step.split
    assert split.flat is not None and "flat AdamW" in split.optimizer_path
    # the gradient the update reads is the step's flat buffer itself: no copy
    assert split.grads[0].data_ptr() == split.flats[0].data_ptr()
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(_optimizer_state(ref), _optimizer_state(model)) <= TOL
    assert "flat update" in parallel.describe()


def test_two_ranks_flat_update_equals_kerass_apply():
    """SGD with Nesterov momentum and global_clipnorm on 2 gloo ranks; Adafactor (not
    covered) keeps Keras's update and describe() says so."""
    x = data("mlp", 97)

    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, global_clipnorm=1.0)

    ref, _ = _fit(mlp, sgd, x, None)
    model, parallel = _fit(mlp, sgd, x, 2)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(_optimizer_state(ref), _optimizer_state(model)) <= TOL
    assert "flat update" in parallel.describe()
    parallel.compile(optimizer=keras.optimizers.Adafactor(), loss="mse", jit_compile=True)
    assert "Adafactor is not one of" in parallel.describe()


def test_captured_evaluate_graphs_are_dropped_when_the_weights_move():
    """The flat optimizer moves the weights into its buffer at the first update (or a
    new layout): test/predict graphs recorded before (an evaluate before fit on a GPU)
    read the old memory, so the next call drops them."""
    import torch

    from kmgpu.engines.torch.capture import eval_steps
    from kmgpu.engines.torch.optim import flat_optim

    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    steps = eval_steps.CapturedEval(model, "cpu", say=None)
    x = torch.zeros(4, 5)
    stale = object()
    steps.graphs["recorded before"] = stale
    flat_optim.FlatOptimizer(model.optimizer, model.trainable_weights)  # moves the weights
    steps.predict_step((x,))
    assert stale not in steps.graphs.values()

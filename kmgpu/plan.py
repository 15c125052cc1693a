"""The batch policy and the printed plan.

``options`` checks what the user chose in ``parallelize`` (the run's ``Config``,
``kmgpu.engines.base``, holds it); ``global_batch`` and ``lr_factor`` turn it into
numbers, ``describe()`` says the whole plan as text (global and per-replica batch, steps
per epoch, learning-rate factor, bytes all-reduced). Stateful RNN models get fixed,
whole, unshuffled batches that split evenly over the replicas (``check_stateful_split``,
``stateful_call``).
"""

import math
import warnings

from kmgpu.engines import global_losses, model_fixes, replication

BATCH_POLICIES = ("global", "per_replica")
#: what ``shard=`` lays out over the devices, 1/N on each: the optimizer state (ZeRO-1),
#: the gradients too (ZeRO-2), the weights too (ZeRO-3 / FSDP); None: nothing
SHARD_CHOICES = (None, "optimizer", "gradients", "weights")
RESET_CHOICES = ("epoch", None)  # stateful RNNs: zero the states each epoch, or never
KERAS_DEFAULT_BATCH = 32


def options(batch="global", scale_lr=None, warmup_epochs=0, sync_batchnorm=False,
            reset_states="epoch", drop_remainder=False, shard=None, shard_optimizer=False,
            tf32=True):
    """Check ``parallelize``'s options; raise ValueError/TypeError saying what to pass.

    Returns:
        The options by name (``scale_lr`` None made True or False, ``shard_optimizer=True``
        made ``shard="optimizer"``), for the run's ``Config`` (``connector.connect`` makes it).
    """
    if batch not in BATCH_POLICIES:
        raise ValueError(
            f"batch={batch!r}: pass batch='global' (fit's batch_size is the global "
            "batch; N devices train like one) or batch='per_replica' (batch_size per "
            "device, global batch = N x batch_size)."
        )
    if scale_lr is None:
        scale_lr = batch == "per_replica"
    if not isinstance(scale_lr, bool):
        raise TypeError(f"scale_lr must be True, False or None, not {scale_lr!r}.")
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int):
        raise TypeError(f"warmup_epochs must be an int >= 0, not {warmup_epochs!r}.")
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs={warmup_epochs}: pass 0 (no warm-up) or more.")
    if warmup_epochs and not scale_lr:
        raise ValueError(
            f"warmup_epochs={warmup_epochs} ramps the learning rate up to N x base, "
            "which only happens with scale_lr=True. Pass scale_lr=True or drop "
            "warmup_epochs."
        )
    if not isinstance(sync_batchnorm, bool):
        raise TypeError(f"sync_batchnorm must be True or False, not {sync_batchnorm!r}.")
    if reset_states not in RESET_CHOICES:
        raise ValueError(f"reset_states={reset_states!r}: pass 'epoch' (zero stateful RNN "
                         "states at each epoch and each evaluate/predict) or None (never; "
                         "call parallel.reset_states() yourself).")
    if not isinstance(drop_remainder, bool):
        raise TypeError(f"drop_remainder must be True or False, not {drop_remainder!r}.")
    if not isinstance(shard_optimizer, bool):
        raise TypeError(f"shard_optimizer must be True or False, not {shard_optimizer!r}.")
    if shard not in SHARD_CHOICES:
        raise ValueError(
            f"shard={shard!r}: pass None (nothing sharded), 'optimizer' (the optimizer state "
            "1/N per device, ZeRO-1), 'gradients' (and the gradients, ZeRO-2) or 'weights' "
            "(and the weights, ZeRO-3 / FSDP).")
    if shard_optimizer:
        if shard not in (None, "optimizer"):
            raise ValueError(
                f"shard_optimizer=True is shard='optimizer', but shard={shard!r} was passed "
                "too: pass only shard=...")
        shard = "optimizer"
    if not isinstance(tf32, bool):
        raise TypeError(f"tf32 must be True (TF32 float32 matmuls on CUDA, as JAX and "
                        f"TensorFlow) or False (full float32), not {tf32!r}.")
    return dict(batch=batch, scale_lr=scale_lr, warmup_epochs=warmup_epochs,
                sync_batchnorm=sync_batchnorm, reset_states=reset_states,
                drop_remainder=drop_remainder, shard=shard, tf32=tf32)


def global_batch(config, batch_size, num_replicas):
    """The global batch a fit/evaluate/predict call uses for the user's batch_size."""
    if batch_size is None:
        batch_size = KERAS_DEFAULT_BATCH
    return batch_size * num_replicas if config.batch == "per_replica" else batch_size


def lr_factor(config, num_replicas):
    return float(num_replicas) if config.scale_lr else 1.0


class PlanText(str):
    """What ``ParallelModel.describe()`` returns: the plan's text, already printed (as
    ``summary()`` prints), so a notebook cell or IPython prompt does not show it again
    as a quoted string."""

    @classmethod
    def show(cls, text, print_fn=None):
        (print_fn or print)(text)
        return cls(text)

    def _ipython_display_(self):  # IPython / Jupyter: printed already
        pass

    def __repr__(self):  # the plain Python prompt: printed already
        return f"<kmgpu plan, {self.count(chr(10)) + 1} lines (printed above; str() for the text)>"


def own_losses_text(backend, template, n):
    """How the model's own losses (``add_loss``) reach one device's value."""
    if n == 1:
        return "as Keras (one replica)"
    if backend == "jax":
        return "on the global batch (one jit over the sharded batch)"
    custom = [layer.name for layer in template._flatten_layers(include_self=True)
              if global_losses.needs_wrapping(layer)]
    if not custom:
        return "Keras's own (means over rows: each replica weighs them by its share)"
    shown = ", ".join(custom[:4]) + (f" and {len(custom) - 4} more" if len(custom) > 4 else "")
    return (f"a layer written outside Keras ({shown}) that adds one runs on the global "
            f"batch on each of the {n} replicas (its inputs all-gathered)")


def describe(*, backend, engine, config, template, samples=None, batch_size=None,
             stateful="none"):
    """The plan, as text."""
    n = engine.num_replicas
    gb = global_batch(config, batch_size, n)
    per = [gb // n + (1 if r < gb % n else 0) for r in range(n)]
    per_text = str(per[0]) if len(set(per)) == 1 else f"{min(per)}-{max(per)} (uneven split)"
    steps = f"{math.ceil(samples / gb)} ({samples} samples)" if samples else "depends on the data"
    params = sum(int(math.prod(v.shape)) * _itemsize(v.dtype) for v in template.trainable_weights)
    moved = _traffic(config.shard, params, n)
    factor = lr_factor(config, n)
    lr = f"x{factor:g} (linear scaling rule)" if config.scale_lr else "x1 (unchanged)"
    if config.warmup_epochs:
        lr += f", warm-up from x1 over {config.warmup_epochs} epoch(s)"
    lines = [
        ("backend", backend),
        ("engine", engine.name),
        ("devices", f"{n}: {', '.join(engine.device_names)}"),
        ("batch policy", config.batch),
        ("global batch", str(gb)),
        ("per-replica batch", per_text),
        ("steps/epoch", steps),
        ("learning rate", lr),
        *([("BatchNorm", engine.batchnorm_mode())] if _has_batchnorm(template) else []),
        *([("train step", step)] if (step := engine.train_step_mode(template)) else []),
        ("stateful RNNs", stateful),
        ("own losses", own_losses_text(backend, template, n)),
        moved,
        ("memory/device", _memory(engine, config, template, params)),
    ]
    width = max(len(k) for k, _ in lines)
    return "kmgpu plan\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in lines)


def _has_batchnorm(template):
    """Whether the model holds a BatchNormalization layer (else describe() has no line
    for it)."""
    import keras

    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in template._flatten_layers(include_self=False))


def _traffic(shard, params, n):
    """The bytes each device sends per step, as (label, text): an all-reduce of the
    gradients; with ``shard`` "optimizer" or "gradients" the same bytes as a
    reduce-scatter of the gradients and an all-gather of the updated weights; with
    "weights" also each layer's weights gathered again for the backward pass."""
    if shard == "weights":
        return ("traffic/step", f"{_bytes(params * 3 * (n - 1) / n)} (params {_bytes(params)} "
                "x 3(N-1)/N: weights all-gathered for the forward and the backward pass, "
                "gradients reduce-scattered)")
    if shard in ("optimizer", "gradients"):
        return ("traffic/step", f"{_bytes(params * 2 * (n - 1) / n)} (params {_bytes(params)} "
                "x 2(N-1)/N: gradients reduce-scattered, weights all-gathered)")
    return ("all-reduce/step", f"{_bytes(params * 2 * (n - 1) / n)} (params {_bytes(params)} "
            "x 2(N-1)/N)")


#: what each ``shard`` value lays out over the devices
SHARDED = {None: (), "optimizer": ("optimizer",), "gradients": ("optimizer", "gradients"),
           "weights": ("optimizer", "gradients", "weights")}


def _memory(engine, config, template, grads):
    """Bytes per device of the weights, the gradients and the optimizer state, as
    ``shard`` lays them out (activations and temporaries not counted): measured by the
    engine where it shards them (``Engine.sharded_bytes``), else whole / N."""
    n = engine.num_replicas
    w = sum(int(math.prod(v.shape)) * _itemsize(v.dtype) for v in replication.weights(template))
    opt = getattr(template, "optimizer", None)
    o = sum(int(math.prod(v.shape)) * _itemsize(v.dtype) for v in replication.optimizer_state(
        opt)) if opt is not None and opt.built else None
    sharded = SHARDED[config.shard] if n > 1 else ()
    parts = []
    for kind, whole in (("weights", w), ("gradients", grads), ("optimizer state", o)):
        key = kind.split()[0]
        measured = engine.sharded_bytes(template, key) if n > 1 else None
        if whole is None and measured is None:
            part = "bytes known once the optimizer is built (after the first fit)"
            parts.append(f"{kind}: 1/{n} per device, {part}" if key in sharded else
                         f"{kind}: {part}")
            continue
        if measured is None:
            measured = (math.ceil(whole / n), whole, 0)
        per, whole, kept = measured
        kept_text = f", {_bytes(kept)} of it whole: no dimension splits over {n}" if kept else ""
        padding = per - kept - math.ceil((whole - kept) / n)
        if padding > 0:  # each piece rounded up to an aligned size (torch's flat buffers)
            kept_text += f", {_bytes(padding)} of it padding: the pieces are aligned"
        if key in sharded:
            parts.append(f"{kind} {_bytes(per)} (1/{n} of {_bytes(whole)}{kept_text})")
        else:
            parts.append(f"{kind} {_bytes(whole)} (whole)")
    where = f"shard={config.shard!r}" if config.shard and n > 1 else "whole on every device"
    return f"{', '.join(parts)}; {where}"


def _itemsize(dtype):
    import numpy as np

    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:
        return 2 if "16" in str(dtype) else 4


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# -- stateful RNNs: fixed, whole, unshuffled batches that split evenly ------------------
def check_stateful_split(model, num_replicas):
    """Raise unless a stateful model can be split into per-replica row blocks: a
    Sequential or functional model (re-created at B/N rows) whose B splits over N."""
    b, n = replication.fixed_batch(model), num_replicas
    if b is not None and not model_fixes.is_functional(model):
        raise TypeError(
            f"{model.name} is a subclassed model with stateful RNN layers: kmgpu re-creates "
            "a stateful model from its Input at each replica's rows, so build it as a "
            "Sequential or functional model (keras.Input(batch_size=...)).")
    if b is None or b % n == 0:
        return
    fits = [k for k in range(1, n + 1) if b % k == 0]
    raise ValueError(
        f"{model.name} is stateful with a fixed batch of {b}, which does not split over {n} "
        f"replicas: each replica must own the same rows every step. Use gpus={max(fits)} "
        f"(any of {fits} divides {b}), or kmgpu.rebatch(model, {b - b % n + n}) (a multiple "
        f"of {n})."
    )


def stateful_call(method, template, call, num_replicas, config, user_batch):
    """Check and adjust a fit / evaluate / predict call for a stateful ``template``.

    Batches are fixed (the model's own batch B, global), whole and unshuffled.

    Args:
        method: "fit", "evaluate" or "predict".
        template: the user's stateful model.
        call: the bound Keras arguments, batch sizes already global.
        num_replicas: N.
        config: the run's ``Config`` (``kmgpu.engines.base``).
        user_batch: the batch_size the user passed (None if left out).

    Returns:
        The call, with batch sizes filled in, shuffle off and, with
        ``config.drop_remainder``, the data cut to whole batches.

    Raises:
        ValueError: sizes that do not split, saying which would.
    """
    b = replication.fixed_batch(template)
    n = num_replicas
    per_replica = config.batch == "per_replica"
    if user_batch is None:
        call["batch_size"] = b
    elif call["batch_size"] != b:
        want = f"batch_size={b // n}" if per_replica and b % n == 0 else f"batch_size={b}"
        raise ValueError(
            f"{template.name} is stateful with a fixed batch of {b} (its Input), but this "
            f"call's global batch is {call['batch_size']}: pass {want}, or make a copy for "
            f"batch {call['batch_size']} with kmgpu.rebatch(model, {call['batch_size']})."
        )
    if "validation_batch_size" in call and call.get("validation_batch_size") not in (None, b):
        raise ValueError(f"{template.name} is stateful with a fixed batch of {b}: pass "
                         f"validation_batch_size={b} (or leave it out).")
    if call.get("validation_split"):
        raise ValueError(
            f"{template.name} is stateful: validation_split would cut a sequence in two. "
            "Pass validation_data=(x_val, y_val) with a multiple of "
            f"{b} samples instead."
        )
    for key in ("x", "y", "sample_weight"):
        if key in call:
            call[key] = _whole_batches(call[key], b, config.drop_remainder, key, method)
    validation = call.get("validation_data")
    if validation is not None:
        call["validation_data"] = tuple(
            _whole_batches(part, b, config.drop_remainder, "validation_data", method)
            for part in validation)
    if method == "fit" and call.get("shuffle"):
        warnings.warn(f"kmgpu: {template.name} is stateful, so fit keeps the batches in order "
                      "(shuffle=False): row i of batch k continues in row i of batch k+1.",
                      stacklevel=4)
        call["shuffle"] = False
    return call


def _whole_batches(data, b, drop, what, method):
    """``data`` cut or checked to a multiple of the batch size."""
    import keras

    if data is None or not hasattr(keras.tree.flatten(data)[0], "shape"):
        return data
    n = int(keras.tree.flatten(data)[0].shape[0])
    if n % b == 0:
        return data
    whole = n - n % b
    if whole == 0:
        raise ValueError(f"{method}: {what} has {n} samples, not a multiple of the stateful "
                         f"batch {b} and less than one batch: pad it to {b} samples.")
    if not drop:
        raise ValueError(
            f"{method}: {what} has {n} samples, not a multiple of the stateful batch {b}: "
            f"pass the first {whole} (or {whole + b} by padding the last batch), or "
            "parallelize(..., drop_remainder=True) to drop the last "
            f"{n % b} sample(s)."
        )
    return keras.tree.map_structure(lambda a: a[:whole], data)

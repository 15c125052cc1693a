"""``shard_optimizer=True`` on JAX: the optimizer's state laid out over the devices
(ZeRO stage 1, Rajbhandari et al. 2020).

Keras gives each optimizer slot (Adam's moments, SGD's momentum, RMSprop's average...)
its weight's layout, which under ``DataParallel`` is a whole copy on every device. Here
the replica's optimizer creates its variables laid out along the device axis instead,
each on the first of its dimensions the device count N divides: every device holds 1/N
of each. Weights and gradients stay replicated, as without the option; Keras's own
jitted train step runs as always, and its ``out_shardings`` (the variables' shardings)
tell XLA to keep the state sharded: XLA's SPMD partitioner computes each device's part
of the update and gathers the new weights.

A variable none of whose dimensions N divides (a bias of 3 on 4 devices, the step
counter, a scalar) stays whole on every device; ``state_bytes`` counts it so.
Nothing changes in the arithmetic: the update is the same elementwise expression, so
the weights equal the unsharded run's.

``use_ema``'s moving averages are slots like the others, sharded. Fit's
``finalize_variable_values`` assigns each to its weight, whose own layout (whole on every
device) places the value whole (``JaxVariable._direct_assign``), and
``optimizer_fixes.separate_ema_overwrite`` gives the weight a copy: the weights stay whole,
the averages sharded, with nothing added here.

The user's model holds the whole state after every ``fit``: ``gather`` brings a
sharded value back whole (the engine's ``copy_back``; under ``kmgpu launch``
``host_value``, which gathers the shards of every process).
"""

from kmgpu.engines.jax import data_fixes, optimizer_fixes


def layout(shape, distribution):
    """The sharded ``TensorLayout`` for a variable of ``shape``, or None (keep it whole):
    the device axis on the first dimension the device count divides."""
    import keras

    n = data_fixes.model_replicas(distribution)
    for i, size in enumerate(shape):
        if size and size >= n and size % n == 0:
            axes = [None] * len(shape)
            axes[i] = distribution.batch_dim_name
            return keras.distribution.TensorLayout(axes, distribution.device_mesh)
    return None


def shard(optimizer, distribution):
    """Lay ``optimizer``'s state (and a wrapped inner optimizer's) out over the devices:
    the variables it creates from now on, and those it has already.

    Idempotent; a no-op on one device.
    """
    if data_fixes.model_replicas(distribution) < 2 or optimizer is None:
        return
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None:
            optimizer_fixes.lay_out_optimizer(opt, lambda shape: layout(shape, distribution))


def gather(value):
    """What ``copy_back`` puts on the template's device for a replica's value: a
    replicated value's first copy, a sharded one as it is (``jax.device_put`` to the
    template's placement gathers it whole)."""
    return value.addressable_shards[0].data if value.sharding.is_fully_replicated else value


def host_value(value):
    """A variable's whole value as a NumPy array, also when its shards span several
    processes (kmgpu launch: every process calls this for the same variables in the
    same order, a collective)."""
    import numpy as np

    if value.is_fully_addressable or value.sharding.is_fully_replicated:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def measured_bytes(variables):
    """(bytes on the fullest device, bytes of the whole values, bytes of the variables
    kept whole on every device) of ``variables``, from their arrays' addressable shards."""
    per_device, whole, kept = {}, 0, 0
    for v in variables:
        a = v.value
        whole += a.nbytes
        kept += a.nbytes if a.sharding.is_fully_replicated else 0
        for s in a.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return max(per_device.values(), default=0), whole, kept


def planned_bytes(variables, n):
    """What ``measured_bytes`` would give with ``variables`` sharded over ``n`` devices by
    ``layout``'s rule (a variable with a dimension n divides: 1/n; else whole)."""
    import numpy as np

    per, whole, kept = 0, 0, 0
    for v in variables:
        size = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
        whole += size
        if any(d and d >= n and d % n == 0 for d in v.shape):
            per += size // n
        else:
            per, kept = per + size, kept + size
    return per, whole, kept


def state_bytes(replica, template, distribution, sharded):
    """``Engine.sharded_bytes("optimizer")``: measured on ``replica`` when its optimizer is sharded
    and built, else planned from whichever optimizer is built (None if neither is)."""
    from kmgpu.engines import replication

    n = data_fixes.model_replicas(distribution)
    for model, measure in ((replica, sharded), (template, False)):
        opt = getattr(model, "optimizer", None)
        if opt is not None and opt.built:
            state = replication.optimizer_state(opt)
            return measured_bytes(state) if measure else planned_bytes(state, n)
    return None

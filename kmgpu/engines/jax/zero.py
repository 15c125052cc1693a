"""``shard=`` on JAX: what is laid out over the devices, 1/N on each, in three stages
(Rajbhandari et al. 2020), every one of them under Keras's own jitted train step.

- ``"optimizer"`` (ZeRO-1): the optimizer's variables. Keras gives each slot (Adam's
  moments, SGD's momentum, RMSprop's average...) its weight's layout, which under
  ``DataParallel`` is a whole copy on every device; here the replica's optimizer creates
  its variables laid out along the device axis instead (``shard``), each on the first of
  its dimensions the device count N divides. Keras's step passes the variables'
  shardings as its ``out_shardings``, so XLA's SPMD partitioner computes each device's
  part of the update and gathers the new weights.
- ``"gradients"`` (ZeRO-2): and the gradients. The replica's optimizer constrains each
  gradient to its slot's layout before the update (``shard_gradients``:
  ``jax.lax.with_sharding_constraint``), so the gradient is reduce-scattered rather than
  all-reduced: each device sums and keeps 1/N of it, updates its piece, and the new
  weights are all-gathered. Weights stay whole on every device. (XLA's GPU pipeline turns
  the all-reduce + slice into a reduce-scatter; its CPU pipeline keeps the all-reduce and
  slices it.)
- ``"weights"`` (ZeRO-3 / FSDP): and the weights. The replica's variables are created laid
  out by the same rule (``Distribution``: floating-point ones, so seed states and counters
  stay whole); the optimizer's slots follow their weights. XLA all-gathers a weight where the
  step needs it whole and frees it after; gradients and the update stay sharded.

On CPU devices XLA's own pipeline would hold every layer's whole weights and summed
gradients at once within a step (its default scheduler gathers every weight at the top,
and it combines the gradients' all-reduces into one at the end): under ``"gradients"`` and
``"weights"`` the replica's steps are compiled with ``step_fixes.SHARDED_CPU_OPTIONS``, per
computation, so a step holds about one layer's whole weights and gradients at a time.

A variable none of whose dimensions N divides (a bias of 3 on 4 devices, the step
counter, a scalar) stays whole on every device; the byte counts (``measured_bytes``,
``planned_bytes``) count it so. Nothing changes in the arithmetic (the same elementwise
update; the same sums, reduced in another order), so weights equal the unsharded run's to
float32 rounding.

``use_ema``'s moving averages are slots like the others, sharded. Fit's
``finalize_variable_values`` assigns each to its weight, whose own layout places the
value (``JaxVariable._direct_assign``), and ``optimizer_fixes.separate_ema_overwrite``
gives the weight a copy.

The user's model holds the trained weights after every ``fit``: ``gather`` brings a sharded
value back whole (the engine's ``copy_back``; under ``kmgpu launch`` ``host_value``,
which gathers the shards of every process). With any ``shard`` value that whole copy
lives in host memory, never on an accelerator; the optimizer's sharded state is gathered
there only when it is read (``host.py``).
"""

from kmgpu.engines.jax import data_fixes, optimizer_fixes


def split_axis(shape, n):
    """The dimension of ``shape`` a variable is sharded on over ``n`` devices (the first
    one ``n`` divides), or None (it stays whole)."""
    for i, size in enumerate(shape):
        if size and size >= n and size % n == 0:
            return i
    return None


def layout(shape, distribution):
    """The sharded ``TensorLayout`` for a variable of ``shape``, or None (keep it whole):
    the device axis on ``split_axis``."""
    import keras

    i = split_axis(shape, data_fixes.model_replicas(distribution))
    if i is None:
        return None
    axes = [None] * len(shape)
    axes[i] = distribution.batch_dim_name
    return keras.distribution.TensorLayout(axes, distribution.device_mesh)


def shards_weight(variable):
    """Whether ``shard="weights"`` lays out a variable: floating-point ones (weights,
    BatchNorm statistics, metrics' accumulators); seed states and counters stay whole."""
    import numpy as np

    return np.issubdtype(np.dtype(variable.dtype), np.floating)


_CLASS = None


def Distribution(devices):
    """``shard="weights"``: a ``keras.distribution.DataParallel`` over ``devices`` (a
    subclass of it) whose ``get_variable_layout``, which Keras asks for the layout of each
    variable made in its scope without one, gives a floating-point variable the sharded
    ``layout`` (where a dimension splits), else Keras's own (whole on every device). Every
    variable the replica makes is laid out so, also the weights of a model first built at
    its first batch; the optimizer's slots are given their layouts by ``shard``."""
    global _CLASS
    if _CLASS is None:
        import keras

        class ShardedWeights(keras.distribution.DataParallel):
            def get_variable_layout(self, variable):
                if getattr(variable, "_layout", None) is None and shards_weight(variable):
                    sharded = layout(tuple(variable.shape), self)
                    if sharded is not None:
                        return sharded
                return super().get_variable_layout(variable)

        _CLASS = ShardedWeights
    return _CLASS(devices=devices)


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


def shard_gradients(optimizer, distribution):
    """``shard="gradients"`` and ``"weights"``: ``optimizer`` (the replica's, outermost:
    a loss-scale wrapper's) constrains each gradient to the sharded ``layout`` of its
    variable's shape before its update. A no-op on one device."""
    if data_fixes.model_replicas(distribution) < 2 or optimizer is None:
        return

    def sharding(shape):
        found = layout(tuple(shape), distribution)
        return None if found is None else found.backend_layout

    optimizer_fixes.constrain_gradients(optimizer, sharding)


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


def planned_bytes(variables, n, sharded=lambda v: True):
    """What ``measured_bytes`` would give with ``variables`` sharded over ``n`` devices by
    ``layout``'s rule (a variable with a dimension n divides, of those ``sharded`` says:
    1/n; else whole)."""
    import numpy as np

    per, whole, kept = 0, 0, 0
    for v in variables:
        size = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
        whole += size
        if split_axis(tuple(v.shape), n) is not None and sharded(v):
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


def weight_bytes(replica, template, distribution, sharded):
    """``Engine.sharded_bytes("weights")``: measured on ``replica``'s weights when they are
    sharded (``shard="weights"``), else planned from the template's (None: not sharded)."""
    from kmgpu.engines import replication

    if not sharded:
        return None
    if replica is not None:
        return measured_bytes(replication.weights(replica))
    return planned_bytes(replication.weights(template), data_fixes.model_replicas(distribution),
                         shards_weight)


def gradient_bytes(template, distribution, sharded):
    """``Engine.sharded_bytes("gradients")``: the gradients live only inside the jitted
    step, so their bytes per device are planned: one per trainable variable, of its dtype,
    laid out as ``shard_gradients`` constrains it (None: not sharded)."""
    if not sharded:
        return None
    return planned_bytes(template.trainable_variables, data_fixes.model_replicas(distribution))

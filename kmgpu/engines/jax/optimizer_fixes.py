"""Keras optimizers on JAX replicas: slots laid out sharded (``shard_optimizer=True``) and
EMA overwrites that leave each variable a buffer of its own; and the user's optimizer
variables holding a replica's sharded arrays until they are read (``hold``). Rows of
``kmgpu/engines/jax/keras_fixes.py``.
"""

import functools

from kmgpu.engines import keras_fixes


def lay_out_optimizer(optimizer, layout_of):
    """``shard_optimizer=True`` (``zero.py``): give ``optimizer``'s variables the layout
    ``layout_of(shape)`` (None: the layout Keras gives).

    Keras's ``add_variable_from_reference`` passes each slot its weight's ``_layout``
    (whole on every device under DataParallel) to ``add_variable``; an instance
    attribute ``add_variable`` (on the replica's optimizer, never the user's) swaps in
    the sharded layout, so a slot is created sharded. Variables the optimizer has
    already are re-laid (``_layout``, then re-assigned: ``_direct_assign`` places the
    value by it).
    """
    def sharded(original):
        def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                         layout=None, name=None):
            layout = layout_of(tuple(shape)) or layout
            return original(shape, initializer=initializer, dtype=dtype,
                            aggregation=aggregation, layout=layout, name=name)
        return add_variable

    if not keras_fixes.install(optimizer, "add_variable", sharded, key="lay_out_optimizer"):
        return
    for v in optimizer.variables:
        new = layout_of(tuple(v.shape))
        if new is not None:
            v._layout = new
            v.assign(v.value)


def separate_ema_overwrite(optimizer):
    """``use_ema``: after Keras overwrites the variables with their averages (the end of
    ``fit``), each variable holds a copy, not its average's own array.

    Keras's ``_overwrite_model_variables_with_average_value`` assigns the average's
    array; a variable and its average sharing one buffer reach the next donated train
    step as two arguments. Replaces the method on ``optimizer`` (and a loss-scale
    wrapper's inner optimizer, which does the overwrite) by an instance attribute.
    """
    import jax.numpy as jnp

    name = "_overwrite_model_variables_with_average_value"
    def copying(original):
        def overwrite(trainable_variables):
            original(trainable_variables)
            for v in trainable_variables:
                v.assign(jnp.copy(v.value))
        return overwrite

    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None and getattr(opt, "use_ema", False):
            keras_fixes.install(opt, name, copying, key="separate_ema_overwrite")


def constrain_gradients(optimizer, sharding_of):
    """``shard="gradients"`` / ``"weights"`` (``zero.py``): inside Keras's jitted train
    step, each gradient constrained to ``sharding_of(shape)`` (a ``jax.sharding``
    sharding; None: left as XLA places it) before ``optimizer``'s update.

    Keras's JAX ``train_step`` hands the gradients of ``jax.value_and_grad`` to
    ``optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)``; an
    instance attribute on the replica's optimizer (never the user's) wraps it. The
    constraint tells XLA's SPMD partitioner that each device needs only its piece of the
    summed gradient: a reduce-scatter instead of an all-reduce. ``optimizer.constrained``
    records the specs of the last trace (for tests).
    """
    import jax

    def constraining(original):
        def stateless_apply(optimizer_variables, grads, trainable_variables):
            out, specs = [], []
            for g in grads:
                where = None if g is None else sharding_of(tuple(g.shape))
                out.append(g if where is None else jax.lax.with_sharding_constraint(g, where))
                specs.append(None if where is None else tuple(where.spec))
            object.__setattr__(optimizer, "constrained", specs)
            return original(optimizer_variables, out, trainable_variables)
        return stateless_apply

    keras_fixes.install(optimizer, "stateless_apply", constraining, key="constrain_gradients")


_HOLDING = {}  # a variable class -> its holding subclass


def hold(variable, value, read):
    """``variable`` holds ``value`` (an array it does not copy) until its value is first
    read; then it keeps ``read(value)`` (e.g. the array gathered to the host) and is a
    plain variable again. Assigning it first lets ``value`` go, unread.

    Keras reads a variable through its ``value`` property (ops, ``numpy()``,
    ``np.asarray``, saving, the JAX trainer's state) and every assignment goes through
    ``_direct_assign``: the variable's class is swapped for a subclass that overrides the
    two (``can_hold``: a plain JAX variable without a layout).
    """
    let_go(variable)
    variable.assign(value)
    variable._kmgpu_read = read
    variable.__class__ = _holding(type(variable))


def held(variable):
    """Whether ``variable`` holds a value not yet read (``hold``)."""
    return type(variable) in _HOLDING.values()


def current(variable):
    """``variable``'s array, without reading a held one."""
    return variable._value if held(variable) else variable.value


def can_hold(variable):
    """Whether ``hold`` applies: a plain Keras JAX variable (NNX variables keep their value
    elsewhere) without a layout (``_direct_assign`` would place the value by it)."""
    import keras

    return ((type(variable) is keras.Variable or held(variable))
            and not keras.config.is_nnx_enabled()
            and getattr(variable, "_layout", None) is None)


def let_go(variable):
    """``variable`` a plain variable again, its value unchanged (the held array)."""
    if held(variable):
        variable.__class__ = type(variable).__mro__[1]
        del variable._kmgpu_read


def _holding(base):
    cls = _HOLDING.get(base)
    if cls is None:
        class Holding(base):
            """A Keras variable holding a value until it is read (``hold``)."""

            @property
            def value(self):
                kept = self._kmgpu_read(self._value)
                let_go(self)
                self.assign(kept)
                return self.value

            def _direct_assign(self, value):
                let_go(self)
                self._direct_assign(value)

        Holding.__name__, Holding.__qualname__ = base.__name__, base.__qualname__
        cls = _HOLDING[base] = Holding
    return cls


def build_holding(optimizer, var_list, arrays):
    """Build ``optimizer`` for ``var_list`` with each variable it makes holding, from the
    start, the next of ``arrays`` (in order) of its shape and dtype, instead of the value
    its initializer would make (zeros for most slots); a variable none fits gets its
    initializer's value.

    For the user's optimizer, built to receive a replica's state (``host.built_on_host``)
    from the replica's own arrays, which ``hold`` or a copy replace at once: no whole
    zeros of every slot on the host first (8 bytes per parameter with Adam). Keras's
    ``add_variable_from_reference`` makes each slot through ``add_variable``, replaced on
    ``optimizer`` by an instance attribute while it builds.

    Returns:
        {id(variable): (variable, its initializer)} of the variables given an array: the
        caller gives any whose array is not the one it replaces next its initial value.
    """
    import numpy as np

    import keras

    queue, given = list(arrays), {}
    original = optimizer.add_variable

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                     layout=None, name=None):
        want = np.dtype(keras.backend.standardize_dtype(dtype or keras.config.floatx()))
        found = next((i for i, a in enumerate(queue) if tuple(a.shape) == tuple(shape)
                      and np.dtype(a.dtype) == want), None)
        if found is None:
            return original(shape, initializer=initializer, dtype=dtype,
                            aggregation=aggregation, layout=layout, name=name)
        array = queue[found]
        del queue[:found + 1]
        variable = original(shape, initializer=functools.partial(_given, array),
                            dtype=dtype, aggregation=aggregation, layout=layout, name=name)
        given[id(variable)] = (variable, keras.initializers.get(initializer))
        return variable

    object.__setattr__(optimizer, "add_variable", add_variable)
    try:
        optimizer.build(var_list)
    finally:
        object.__delattr__(optimizer, "add_variable")
    return given


def _given(value, shape, dtype=None):
    """An initializer that returns ``value`` itself."""
    return value

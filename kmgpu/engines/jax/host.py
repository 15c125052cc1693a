"""Where the user's model keeps its whole state while ``shard=`` is set: host memory.

Sharding is for a model whose whole state does not fit one accelerator. The replicas hold
it laid out over the devices (``zero.py``); the user's own model (the template) must not
hold a whole copy of it on an accelerator too, so with any ``shard`` value its weights and
its optimizer's variables are arrays on the host CPU device
(``jax.local_devices(backend="cpu")[0]``, committed there):

- before each call (``to_host``): a template array found on another device (the user built
  or trained the model on the default accelerator) is moved to the host;
- the template's optimizer, when kmgpu builds it to receive the trained state, is built on
  the host (``built_on_host``);
- after ``fit`` the engine's ``copy_back`` writes the replicas' state to the template's
  arrays, which are on the host: a sharded value is gathered there, piece by piece.

So ``model.save``, ``load_model``, ``get_weights`` and kmgpu's next call read host memory.
A direct call on the model itself (``model.predict`` outside kmgpu) then runs where its
arrays are, on the host CPU; ``keras``'s own ``fit`` puts them back on the accelerator.
On a machine without accelerators the host device is device 0 (nothing moves).

The optimizer's sharded state is not gathered after a fit (``hold``): the user's
optimizer variable holds the replica's own sharded array (JAX arrays are immutable, so no
copy is made) and is gathered whole to the host the first time its value is read:
``model.optimizer.variables[i].value``, ``numpy()``, ``model.save`` with the optimizer,
Keras's own ``fit`` on the model. Assigning it lets go of the replica's array. So between
fits the host keeps the trained weights, and the optimizer state only where something
asked for it. kmgpu's own calls read the held array itself (``current``): a next fit
finds it equal to the replica's and copies nothing in. Under ``kmgpu launch`` (several
processes) the state is gathered at once, as reading it is a collective.
"""

import contextlib

from kmgpu.engines.jax import optimizer_fixes


def device():
    """The host CPU device the template's whole state lives on."""
    import jax

    return jax.local_devices(backend="cpu")[0]


def to_host(variables):
    """Move each variable's array that is not on the host CPU device there (one batched
    transfer)."""
    import jax

    host = device()
    away = [v for v in variables if not held(v) and getattr(v, "value", None) is not None
            and v.value.devices() != {host}]
    if away:
        for v, a in zip(away, jax.device_put([v.value for v in away], host, may_alias=False)):
            v.assign(a)


def template_variables(template):
    """The template's weights and its optimizer's state (where built): what sharding keeps
    off the accelerators."""
    from kmgpu.engines import replication

    variables = list(replication.weights(template))
    opt = getattr(template, "optimizer", None)
    if opt is not None and opt.built:
        variables += replication.optimizer_state(opt)
    return variables


def built_on_host(template, replica):
    """Build the template's optimizer on the host when the replica's is built and the
    template's is not: the trained state is copied back into it next (Keras builds an
    optimizer's variables on the default device, an accelerator).

    Each variable starts as the replica's array in its place, not as zeros
    (``optimizer_fixes.build_holding``): the copy back holds or copies it next, and the
    host never holds whole zeros of every slot."""
    import jax

    opt = getattr(template, "optimizer", None)
    theirs = getattr(replica, "optimizer", None)
    if opt is None or opt.built or theirs is None or not theirs.built:
        return
    from kmgpu.engines import replication

    theirs = replication.optimizer_state(theirs)
    with jax.default_device(device()):
        given = optimizer_fixes.build_holding(opt, template.trainable_variables,
                                              [v.value for v in theirs])
        # the copy back pairs the two optimizers' state in order: a variable not holding
        # its pair's array (none, or another) starts from its initializer's value
        mine = replication.optimizer_state(opt)
        pairs = ({id(t): r.value for t, r in zip(mine, theirs)}
                 if [v.shape for v in mine] == [v.shape for v in theirs] else {})
        for variable, initializer in given.values():
            if pairs.get(id(variable)) is not current(variable):
                variable.assign(initializer(variable.shape, dtype=variable.dtype))
    to_host([v for v in template_variables(template) if id(v) not in given])


def writers_read_template(engine, template, callbacks):
    """``callbacks`` for a fit whose state is spread over several processes
    (``jax.distributed`` with ``shard=``), where process 0 alone cannot read it: the
    writers (``environment.writers``: ModelCheckpoint, BackupAndRestore, ...) read the
    user's model, and every process copies the replica's state into it (a collective
    gather, ``engine.copy_back``) at every epoch end before they run, and at every step's
    end where a writer saves by steps. A backup is still restored into the replica.

    Returns:
        The callbacks, with the copy first (unchanged where there is no writer).
    """
    import warnings

    import keras

    from kmgpu import environment
    from kmgpu.engines import replication

    found = environment.writers(callbacks)
    if not found:
        return callbacks
    for w in found:
        w.writes_from = template
    by_steps = [type(w.writer).__name__ for w in found
                if isinstance(getattr(w.writer, "save_freq", "epoch"), int)]
    if by_steps:
        warnings.warn(
            f"kmgpu: {', '.join(by_steps)} with an integer save_freq in a multi-process "
            "job with shard= gathers the whole state from every process at every step "
            "(it saves from process 0, which holds only its pieces). save_freq='epoch' "
            "gathers once per epoch.", stacklevel=4)

    class CopyForWriters(keras.callbacks.Callback):
        def copy(self):
            replica = self.model  # (Keras's JAX callbacks sync its state on this read)
            with outside_distribution():  # the template's variables stay plain
                built_on_host(template, replica)
                engine.copy_back(replication.state_pairs(replica, template))

        def on_epoch_end(self, epoch, logs=None):
            self.copy()

    if by_steps:
        CopyForWriters.on_train_batch_end = lambda self, batch, logs=None: self.copy()
    return [CopyForWriters()] + list(callbacks)


# -- the optimizer state held, not gathered -------------------------------------------
def held(variable):
    """Whether ``variable`` holds a replica's sharded array, not yet gathered (``hold``)."""
    return optimizer_fixes.held(variable)


def current(variable):
    """``variable``'s array without gathering a held one (what kmgpu compares)."""
    return optimizer_fixes.current(variable)


def can_hold(variable):
    """Whether ``hold`` applies to ``variable`` (``optimizer_fixes.can_hold``)."""
    return optimizer_fixes.can_hold(variable)


def hold(variable, source, sync):
    """``variable`` (the user's) takes ``source``'s (the replica's) sharded array itself,
    to be gathered to the host when its value is first read. The array is immutable; if
    the replica's next train step has donated it by then (the user's model read from a
    callback during a later fit), the replica's state at that step is gathered instead
    (``sync()``: Keras's ``jax_state_sync``, as a callback's ``self.model`` does)."""
    import jax

    def gathered(value):
        if value.is_deleted():  # the replica's step took it: its state since
            sync()
            value = source._value
        return jax.device_put(value, device(), may_alias=False)

    optimizer_fixes.hold(variable, source.value, gathered)


@contextlib.contextmanager
def outside_distribution():
    """Within the block no ``keras.distribution`` is set (a variable made there has no
    layout: the template's, made inside a fit that runs under the engine's)."""
    import keras

    current = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(current)

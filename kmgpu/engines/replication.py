"""Replicas of the user's model: the one factory every engine makes them with
(``make_replica``), clone, compile settings, the identity that says when a replica still
matches, and the weights, optimizer state, learning rate and stateful RNN state rows copied
between the user's model and its replicas.

Keras fixes a variable's placement when it is created, so an engine re-creates
the user's model (the *template*) inside its own scope and copies weights and
optimizer state in and out.

Stateful RNN layers keep one state row per batch row, in untracked non-trainable
variables of shape (batch, units) (not in ``model.weights``, never saved). State
carries from row i of batch k to row i of batch k+1, so batches are fixed: the
global batch B is the model's own ``Input(batch_size=B)`` and replica r always
owns rows r*B/N ... (r+1)*B/N - 1. The template holds the states between calls,
like the weights; engines copy them into their replicas' rows and back.
"""

import contextlib
import random
import sys

import keras
import numpy as np

from kmgpu.engines import after_build, global_losses, model_fixes, user_objects


def identity(template):
    """What decides whether a cached replica still matches the template: its layers and
    variables (the objects, and which train), each layer's plain settings (a Dropout's rate set after
    wrapping), its compile() and optimizer, and the state its adapted layers keep
    beside their weights (a layer adapted again needs a replica loaded again).

    Cheap (no ``get_config``): it is read at every call."""
    layers = tuple((id(layer), layer.trainable,
                    None if isinstance(layer, keras.Model) else _settings(layer))
                   for layer in template._flatten_layers(include_self=True))
    optimizer = getattr(template, "optimizer", None)
    return (layers, tuple((id(v), v.trainable) for v in template.weights), template.compiled,
            id(getattr(template, "_compile_config", None)),
            id(optimizer) if optimizer is not None else None,
            _digest(model_fixes.own_state(template)))


#: what ``Layer.__call__`` records on a layer at its calls (whether it was called, the
#: path of the layer that called it): bookkeeping, not settings. A layer whose sublayers
#: are first called in the first step (keras-hub's decoder blocks, any layer that builds
#: its sublayers in ``build``) would otherwise look like another model at the next call,
#: and the engines would make their replicas and captured steps again
CALL_BOOKKEEPING = ("_called", "_parent_path")


def _settings(layer):
    """A layer's attributes that hold plain values (numbers, strings, flags), Keras's
    call bookkeeping left out."""
    return tuple((key, value) for key, value in vars(layer).items()
                 if key not in CALL_BOOKKEEPING
                 and (value is None or type(value) in (bool, int, float, str)))


def _digest(state):
    """A short fingerprint of ``own_state``'s data (None: None)."""
    if state is None:
        return None
    import hashlib

    digest = hashlib.sha1()

    def add(node):
        if isinstance(node, dict):
            for key in sorted(node):
                digest.update(str(key).encode())
                add(node[key])
        elif node is not None:
            array = np.asarray(node)
            digest.update(str((array.dtype, array.shape)).encode())
            digest.update(array.tobytes() if array.dtype != object else repr(array).encode())

    add({"weights": state[0], "assets": state[1]})
    return digest.hexdigest()


def carried(template):
    """What a replica needs from ``template`` beside its config, compile config and
    weights, as picklable data: the state Keras's saving path writes for its adapted
    layers (``model_fixes.own_state``), its optimizer's settings outside its config
    (``model_fixes.optimizer_settings``) and what was done to it after it was built
    (``after_build.state``: LoRA, trainable flags). ``load_carried`` puts it into a
    replica."""
    return (model_fixes.own_state(template), model_fixes.optimizer_settings(template),
            after_build.state(template))


def load_carried(replica, carried, compiled=False):
    """Put ``carried(template)`` into a replica built from the template's config:
    before compile, what was done after build and the layers' state (through Keras's
    own ``load_own_variables`` / ``load_assets``, which finalize adapted layers); after
    compile (``compiled=True``), the optimizer's settings."""
    layers, optimizer, built = (tuple(carried) + (None,))[:3]
    if compiled:
        model_fixes.apply_optimizer_settings(replica, optimizer)
    else:
        after_build.replay(replica, built)
        model_fixes.load_own_state(replica, layers)


@contextlib.contextmanager
def host_random_kept():
    """Making a replica draws nothing a seeded script would see.

    Keras seeds every ``SeedGenerator`` made without a seed (each initializer's, a
    Dropout's) from Python's ``random``, so cloning a model advances it, and building
    one may draw NumPy's or torch's generators. Plain Keras makes no model inside
    ``fit``: a seeded script's next draws there (a ``PyDataset``'s shuffled batch order,
    the user's own ``random`` / NumPy / torch calls) would come out otherwise. The
    replica's weights are copied from the template, so its draws are of no use."""
    saved = host_random_state()
    try:
        yield
    finally:
        set_host_random_state(saved)


def host_random_state():
    """The host random states Keras draws from: Python's ``random``, NumPy's global
    generator and, where torch is imported, its default CPU generator (None otherwise)."""
    torch = sys.modules.get("torch")
    return (random.getstate(), np.random.get_state(),
            torch.get_rng_state() if torch is not None else None)


def set_host_random_state(saved):
    """Put back what ``host_random_state`` gave."""
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    if saved[2] is not None:
        sys.modules["torch"].set_rng_state(saved[2])


def clone(template):
    """A new model with the template's architecture (weights are copied separately).

    Classes and functions the script defined without registering them (a layer, a
    loss, a metric...) are found on the template's own objects (``custom_objects``):
    plain Keras never needs registration to fit, so kmgpu must not either. A Python
    lambda (a ``Lambda`` layer's) is the user's own function, not its bytecode
    (``user_objects.live_config``).
    """
    custom = user_objects.custom_objects(template)
    with keras.saving.custom_object_scope(custom):
        replica = None
        if isinstance(template, keras.Sequential) or getattr(template, "_is_graph_network",
                                                             False):
            replica = keras.models.clone_model(
                template, clone_function=lambda layer: _clone_layer(layer, custom))
        if type(replica) is not type(template):  # subclassed; or a Sequential subclass,
            # which clone_model turns into a plain Sequential (dropping the user's train_step)
            replica = _clone_layer(template, custom)
        if not replica.built:
            build_config = template.get_build_config()
            if build_config:
                replica.build_from_config(build_config)
        load_carried(replica, carried(template))
    return replica


def _clone_layer(layer, custom):
    """``clone_model``'s default clone of a layer, with the user's live functions
    (``custom``: the model's ``custom_objects``; a scope replaces the one around it)."""
    config, live = user_objects.live_config(layer)
    with keras.saving.custom_object_scope({**custom, **live}):
        return layer.__class__.from_config(config)


# -- the one replica factory ------------------------------------------------------------
class FromTemplate:
    """The user's model as the source of a replica in this process.

    A source is what ``make_replica`` reads: ``model(rows)`` an uncompiled copy (for a
    stateful RNN model built for B rows, rebuilt for ``rows(B)``), ``compile_args()``
    the compile() arguments with fresh optimizer and metric objects, ``compiled`` and
    ``carried`` (``carried``). A pool worker's source is the template sent as data
    (``engines.torch.replicas.FromSpec``).
    """

    def __init__(self, template):
        self.template = template
        self.compiled = template.compiled
        self._carried = None

    @property
    def carried(self):
        if self._carried is None:
            self._carried = carried(self.template)
        return self._carried

    def model(self, rows):
        """``clone``, or ``clone_at`` ``rows(B)`` for a stateful RNN model built for B."""
        fixed = fixed_batch(self.template)
        return clone(self.template) if fixed is None else clone_at(self.template, rows(fixed))

    def compile_args(self):
        return compile_args(self.template)


def make_replica(source, rows=None, lr_scale=(1.0, 0), prepare=None, finish=None,
                 keep_host_random=True):
    """A replica, the one way every engine makes one: TensorFlow's and JAX's in this
    process, a torch rank's under torchrun, a torch pool worker's.

    The uncompiled copy comes from ``source``; its layers that add a loss run on the
    global batch inside kmgpu's steps (``global_losses.install``); ``prepare`` adjusts
    it; it is compiled as the template is (``compile_like``, the learning rate scaled
    as ``lr_scale`` says); ``finish`` turns it into the engine's replica.

    Args:
        source: the user's model (the template), or a source made from it elsewhere
            (``FromTemplate`` says what a source holds).
        rows: for a stateful RNN model built for the global batch B, the rows this
            replica keeps, as a function of B (None: all B).
        lr_scale: (factor, warmup_steps) for a LearningRateSchedule (``scale_schedule``).
        prepare: the engine's hook on the uncompiled replica (per-replica or synchronised
            BatchNorm, its own steps); returns nothing.
        finish: the engine's hook on the compiled replica; returns the replica.
        keep_host_random: make it inside ``host_random_kept`` (the user's process: a
            seeded script's draws stay as they were; a pool worker's are its own).

    Returns:
        The replica (its weights come next, copied from the template).
    """
    if isinstance(source, keras.Model):
        source = FromTemplate(source)
    with host_random_kept() if keep_host_random else contextlib.nullcontext():
        replica = source.model(rows or (lambda batch: batch))
        keras_methods(replica)
        global_losses.install(replica)
        if prepare is not None:
            prepare(replica)
        if source.compiled:
            compile_like(replica, source, lr_scale)
        if finish is not None:
            replica = finish(replica)
    return replica


#: the methods a model's class may have its own of, which kmgpu runs on the user's model
#: (``kmgpu.own_methods``) and a replica runs as Keras's
KERAS_METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                 "predict_on_batch")


def keras_methods(replica):
    """Make ``replica`` run Keras's own fit / evaluate / predict (and ``*_on_batch``)
    where its class has its own: that one ran on the user's model already, up to its
    call of ``keras.Model``'s, and the engines get what it passed there (keras-hub's
    tasks: the preprocessed ``tf.data`` pipeline, not the raw data)."""
    import types

    for name in KERAS_METHODS:
        keras_method = getattr(keras.Model, name)
        if getattr(type(replica), name) is not keras_method:
            setattr(replica, name, types.MethodType(keras_method, replica))


def compile_like(replica, source, lr_scale=(1.0, 0)):
    """Compile ``replica`` as the template is compiled (``compile_args``), its optimizer's
    LearningRateSchedule scaled as ``lr_scale`` says (``scale_schedule``) and with the
    template's settings outside the config (``carried``).

    Args:
        source: the template, or a source made from it (``FromTemplate``).
    """
    if isinstance(source, keras.Model):
        source = FromTemplate(source)
    replica.compile(**scale_schedule(source.compile_args(), lr_scale))
    load_carried(replica, source.carried, compiled=True)


def compile_args(template):
    """The template's compile() arguments, with fresh optimizer and metric objects.

    An optimizer or metric instance belongs to one model, so the replica gets new ones
    (``user_objects.compile_recipe``); losses are the user's own objects.
    """
    with keras.saving.custom_object_scope(user_objects.custom_objects(template)):
        return user_objects.compile_args(user_objects.compile_recipe(template))


def scale_schedule(args, lr_scale):
    """``compile()`` arguments whose optimizer's LearningRateSchedule is wrapped in
    ``lr.ScaledSchedule`` when ``lr_scale`` = (factor, warmup_steps) asks for scaling
    (a float rate is scaled by ``lr.LRScaling``, a callback)."""
    from kmgpu.engines import lr

    optimizer = args.get("optimizer")
    factor, warmup_steps = lr_scale
    if isinstance(optimizer, str):
        args["optimizer"] = optimizer = keras.optimizers.get(optimizer)
    if (factor != 1.0 or warmup_steps) and lr.is_schedule(optimizer):
        optimizer.learning_rate = lr.ScaledSchedule(optimizer._learning_rate, factor,
                                                    warmup_steps)
    return args


def numpy_dtype(dtype):
    """The NumPy dtype of a Keras dtype name (ml_dtypes' for those NumPy lacks): how a
    state array of that variable is held outside Keras."""
    try:
        return np.dtype(dtype)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))


def optimizer_state(optimizer):
    """The optimizer's state variables (step count, moments), not its learning rate."""
    lr = getattr(optimizer, "_learning_rate", None)
    return [v for v in optimizer.variables if v is not lr]


def weights(model):
    """``model.weights`` without stateful RNN states (an engine may track those)."""
    states = {id(v) for v in state_variables(model)}
    return [v for v in model.weights if id(v) not in states]


def state_pairs(src, dst):
    """(src variable, dst variable) for the weights, then the optimizer state where
    ``src``'s optimizer has any (``dst``'s is built first when it is not yet): what
    ``copy_state`` copies, in its order."""
    src_w, dst_w = weights(src), weights(dst)
    if [tuple(v.shape) for v in src_w] != [tuple(v.shape) for v in dst_w]:
        raise ValueError(f"{dst.name}'s weights no longer match {src.name}'s.")
    pairs = list(zip(src_w, dst_w))
    src_opt = getattr(src, "optimizer", None)
    dst_opt = getattr(dst, "optimizer", None)
    if src_opt is None or dst_opt is None or not src_opt.built:
        return pairs
    if not dst_opt.built:
        dst_opt.build(dst.trainable_variables)
    src_vars, dst_vars = optimizer_state(src_opt), optimizer_state(dst_opt)
    if [tuple(v.shape) for v in src_vars] != [tuple(v.shape) for v in dst_vars]:
        return pairs  # a different optimizer: keep dst's own state
    return pairs + list(zip(src_vars, dst_vars))


def copy_state(src, dst, pairs=None, skip=None):
    """Copy weights, and optimizer state where ``src``'s optimizer has any, src -> dst.

    Args:
        pairs: ``state_pairs(src, dst)`` when the caller has them already.
        skip: one bool per pair: True leaves that variable alone (it holds the
            same value already).
    """
    pairs = state_pairs(src, dst) if pairs is None else pairs
    for i, (s, d) in enumerate(pairs):
        if skip is None or not skip[i]:
            d.assign(keras.ops.convert_to_numpy(s.value))


def lr_variable(model):
    """The variable ``model``'s optimizer holds its learning rate in (None: no optimizer,
    or a schedule)."""
    lr = getattr(getattr(model, "optimizer", None), "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def copy_lr(src, dst):
    """Copy the learning rate ``src``'s optimizer holds in a variable to ``dst``'s."""
    a, b = lr_variable(src), lr_variable(dst)
    if a is not None and b is not None and a is not b:
        b.assign(keras.ops.convert_to_numpy(a.value))


def stateful_layers(model):
    """The stateful RNN layers of ``model`` (nested ones included), in order."""
    import keras

    return [layer for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.RNN) and layer.stateful]


def state_variables(model):
    """The state variables of every stateful RNN layer, flat, in layer order."""
    import keras

    return [v for layer in stateful_layers(model) if layer.states is not None
            for v in keras.tree.flatten(layer.states)]


def fixed_batch(model):
    """The batch size a stateful model was built for, or None for a stateless model."""
    variables = state_variables(model)
    return int(variables[0].shape[0]) if variables else None


def reset_states(model):
    """Zero every state row of ``model``."""
    for layer in stateful_layers(model):
        layer.reset_state()


def clone_at(model, batch_size):
    """An uncompiled copy of a Sequential / functional model built for ``batch_size``."""
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=(batch_size,) + tuple(t.shape[1:]), dtype=t.dtype),
        model.inputs[0] if isinstance(model, keras.Sequential) else model.input)
    custom = user_objects.custom_objects(model)
    with keras.saving.custom_object_scope(custom):
        new = keras.models.clone_model(model, input_tensors=inputs,
                                       clone_function=lambda layer: _clone_layer(layer, custom))
        load_carried(new, carried(model))
    return new


def reset_callback(model):
    """A Keras callback that zeroes ``model``'s states at the start of every epoch."""
    class ResetStates(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            reset_states(model)

    return ResetStates()

"""The user's own objects, as they reach a replica: what a config cannot carry.

A replica is made from the template's config (Keras fixes a variable's placement
when it is created), but a config is not the object the user passed:

- a ``Lambda`` layer's Python lambda serializes as bytecode, which Keras's safe mode
  refuses to load, and which loses its globals when loaded anyway; ``live_config``
  puts the user's own function objects back in place of those entries;
- a loss or metric whose ``get_config`` drops an argument (Keras's ``Huber`` drops
  ``delta``) comes back from its config with the default; ``compile_recipe`` keeps
  the losses themselves and each metric's settings beside its config.

``custom_objects`` finds the classes and functions from outside Keras that the model's
config and compile() name, on the model's own objects (plain Keras never needs them
registered to fit, so kmgpu must not either).

These results are plain data and functions: ``kmgpu.engines.torch`` sends them to its
workers pickled by value (cloudpickle), so every replica, in this process or another,
is made from the same recipe.
"""

import inspect
import types

import keras

#: the start of the names that stand for a live object in a config
_TOKEN = "kmgpu-live-object:"


def live_config(obj, config=None):
    """``obj.get_config()`` (or ``config``, a serialized form of ``obj``) with every
    Python lambda that the config would carry as bytecode replaced by a name that
    resolves to the user's own function.

    Args:
        obj: a layer or model of the user's (its sublayers are searched by name).
        config: the config to rewrite (default: ``obj.get_config()``).

    Returns:
        (config, {name: function}): deserialize the config inside
        ``keras.saving.custom_object_scope`` of that dict.
    """
    config = obj.get_config() if config is None else config
    layers = {layer.name: layer for layer in _layers(obj)}
    live = {}

    def rewrite(node):
        if isinstance(node, dict):
            inner = node.get("config")
            if isinstance(inner, dict) and inner.get("name") in layers:
                _substitute(layers[inner["name"]], inner, live)
            for value in node.values():
                rewrite(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                rewrite(value)

    if isinstance(obj, keras.layers.Layer):
        _substitute(obj, config, live)
    rewrite(config)
    return config, live


def _layers(obj):
    if isinstance(obj, keras.layers.Layer):
        return list(obj._flatten_layers(include_self=True))
    return []


def _substitute(layer, config, live):
    """Replace ``layer``'s lambdas in its own ``config`` (in place)."""
    for key, value in list(config.items()):
        if not (isinstance(value, dict) and value.get("class_name") == "__lambda__"):
            continue
        fn = _attribute(layer, key)
        if fn is None:
            continue
        if isinstance(layer, keras.layers.Lambda) and key == "mask":
            config[key] = fn  # Lambda.from_config passes its mask through as given
        else:
            name = f"{_TOKEN}{id(fn)}"
            live[name] = fn
            config[key] = name


def _attribute(layer, key):
    """The function ``layer`` holds for its config entry ``key`` (None: not found)."""
    if isinstance(layer, keras.layers.Lambda) and key == "output_shape":
        key = "_output_shape"
    for name in (key, f"_{key}"):
        value = getattr(layer, name, None)
        if isinstance(value, types.FunctionType):
            return value
    return None


# -- compile arguments ------------------------------------------------------------------
class Fresh:
    """A new instance of an object that holds variables of its own (a metric, an
    optimizer), made from its class and config; with ``settings``, the plain
    attributes of the user's instance that its config drops are put back (an
    optimizer's are ``model_fixes.optimizer_settings``, applied after compile)."""

    def __init__(self, obj, settings=True):
        self.cls = type(obj)
        self.config = obj.get_config()
        self.settings = {}
        if settings:
            fresh = vars(self.cls.from_config(dict(self.config)))
            self.settings = {key: value for key, value in vars(obj).items()
                             if key not in _STATE and _plain(value) and key in fresh
                             and not _same(fresh[key], value)}

    def make(self):
        obj = self.cls.from_config(dict(self.config))
        for key, value in self.settings.items():
            setattr(obj, key, value)
        return obj


class Shared:
    """A stateless object (a loss) as the user made it: its attributes travel as they
    are, not through its config (which Keras's own pickling goes through)."""

    def __init__(self, obj):
        self.obj = obj

    def __reduce__(self):
        return _rebuilt, (type(self.obj), dict(vars(self.obj)))

    def make(self):
        return self.obj


def _rebuilt(cls, attributes):
    obj = cls.__new__(cls)
    vars(obj).update(attributes)
    return Shared(obj)


#: attributes that say where an instance is in its life, not how the user set it up
_STATE = frozenset({"built", "_built"})


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str, types.FunctionType)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:
        return False


def compile_recipe(template):
    """The template's ``compile()`` arguments as a recipe: losses kept as the user's
    objects (``Shared``), optimizers and metrics as ``Fresh`` (an instance belongs to
    one model), everything else as given. ``compile_args`` makes the arguments."""
    args = dict(template._compile_config.config)
    optimizer = args.get("optimizer")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        args["optimizer"] = Fresh(optimizer, settings=False)
    for key in ("loss", "loss_weights"):
        if args.get(key) is not None:
            args[key] = keras.tree.map_structure(
                lambda v: Shared(v) if isinstance(v, keras.losses.Loss) else v, args[key])
    for key in ("metrics", "weighted_metrics"):
        if args.get(key) is not None:
            args[key] = keras.tree.map_structure(
                lambda v: Fresh(v) if isinstance(v, keras.metrics.Metric) else v, args[key])
    return args


def compile_args(recipe):
    """``compile()``'s keyword arguments from a ``compile_recipe``: new optimizer and
    metric instances, the user's losses."""
    return {key: keras.tree.map_structure(
        lambda v: v.make() if isinstance(v, (Fresh, Shared)) else v, value)
        if value is not None else None for key, value in recipe.items()}


def custom_objects(template):
    """{name: class or function} of what the model's config and its compile() need
    from outside Keras: its layer classes and the functions and Keras objects its
    layers hold (activations, initializers...), the objects its compile arguments
    hold, and whatever registered objects its serialized configs name (schedules,
    initializers, regularizers...). For ``keras.saving.custom_object_scope``.
    """
    import types

    custom = {}

    def add(obj):
        cls = obj if isinstance(obj, type) or not hasattr(obj, "get_config") else type(obj)
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("keras") or module == "builtins" or not callable(cls):
            return
        try:
            name = keras.saving.get_registered_name(cls)
        except Exception:
            name = getattr(cls, "__name__", None)
        if name:
            custom[name] = cls
            custom.setdefault(getattr(cls, "__name__", name), cls)

    def walk(node):
        if isinstance(node, dict):
            module, name = node.get("module"), node.get("registered_name")
            if isinstance(module, str) and isinstance(name, str) and \
                    not module.startswith("keras") and name != "function":
                obj = keras.saving.get_registered_object(name)
                if obj is not None:
                    add(obj)
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    saveable = (keras.layers.Layer, keras.losses.Loss, keras.metrics.Metric,
                keras.initializers.Initializer, keras.regularizers.Regularizer,
                keras.constraints.Constraint, keras.optimizers.schedules.LearningRateSchedule)
    for layer in template._flatten_layers(include_self=True):
        add(layer)
        for value in vars(layer).values():
            if inspect.ismethod(getattr(value, "__wrapped__", None)):
                continue  # Keras's wrapper of the layer's own build (the class is added)
            if isinstance(value, (types.FunctionType, saveable)):
                add(value)
    walk(keras.saving.serialize_keras_object(template))
    if template.compiled:
        config = template._compile_config.config
        for key in ("optimizer", "loss", "metrics", "weighted_metrics", "loss_weights"):
            value = config.get(key)
            if value is None or isinstance(value, str):
                continue
            for leaf in keras.tree.flatten(value):
                if leaf is not None and not isinstance(leaf, (str, int, float)):
                    add(leaf)
            if key == "optimizer" and isinstance(value, keras.optimizers.Optimizer):
                add(getattr(value, "_learning_rate", None))
        walk(template.get_compile_config())
    return custom

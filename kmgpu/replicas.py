"""Backend-neutral helpers to re-create the user's model and move state between copies.

Keras fixes a variable's placement when it is created, so an engine re-creates
the user's model (the *template*) inside its own scope and copies weights and
optimizer state in and out. These helpers only use Keras's public model API.
"""

import json

import keras


def check_model(model):
    """Raise TypeError unless ``model`` is a built Keras model kmgpu can re-create."""
    if not isinstance(model, keras.Model):
        what = type(model).__name__
        hint = " Wrap your layer in keras.Sequential([...]) first." if isinstance(
            model, keras.layers.Layer
        ) else ""
        raise TypeError(f"kmgpu.parallelize needs a keras.Model, got a {what}.{hint}")
    if not model.built:
        raise ValueError(
            "kmgpu.parallelize needs a built model: give it an Input(shape=...), or call "
            "model.build(input_shape) or model(x) once before wrapping it."
        )
    try:
        model.get_config()
    except NotImplementedError:
        raise TypeError(
            f"{type(model).__name__} has no get_config(): kmgpu re-creates the model on "
            "each device from its config. Implement get_config() (and from_config() if "
            "__init__ takes non-serialisable arguments) on your subclassed model."
        ) from None


def identity(template):
    """What decides whether a cached replica still matches the template."""
    config = json.dumps(template.get_config(), sort_keys=True, default=repr)
    optimizer = getattr(template, "optimizer", None)
    return (config, template.compiled, id(optimizer) if optimizer is not None else None)


def clone(template):
    """A new model with the template's architecture (weights are copied separately)."""
    if isinstance(template, keras.Sequential) or getattr(template, "_is_graph_network", False):
        replica = keras.models.clone_model(template)
    else:
        replica = template.__class__.from_config(template.get_config())
    if not replica.built:
        build_config = template.get_build_config()
        if build_config:
            replica.build_from_config(build_config)
    return replica


def compile_args(template, lr_scale=(1.0, 0)):
    """The template's compile() arguments, with fresh optimizer and metric objects.

    An optimizer or metric instance belongs to one model, so the replica gets copies
    made from their configs; losses are stateless and shared. A learning-rate
    schedule is wrapped in ``lr.ScaledSchedule`` when ``lr_scale`` = (factor,
    warmup_steps) asks for scaling (a float rate is scaled by ``lr.LRScaling``).
    """
    from kmgpu import lr

    args = dict(template._compile_config.config)
    optimizer = args.get("optimizer")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
        factor, warmup_steps = lr_scale
        if lr.is_schedule(optimizer) and (factor != 1.0 or warmup_steps):
            optimizer.learning_rate = lr.ScaledSchedule(optimizer._learning_rate, factor,
                                                        warmup_steps)
        args["optimizer"] = optimizer
    for key in ("metrics", "weighted_metrics"):
        if args.get(key) is not None:
            args[key] = keras.tree.map_structure(_fresh_metric, args[key])
    return args


def _fresh_metric(metric):
    if isinstance(metric, keras.metrics.Metric):
        return metric.__class__.from_config(metric.get_config())
    return metric


def optimizer_state(optimizer):
    """The optimizer's state variables (step count, moments), not its learning rate."""
    lr = getattr(optimizer, "_learning_rate", None)
    return [v for v in optimizer.variables if v is not lr]


def weights(model):
    """``model.weights`` without stateful RNN states (an engine may track those)."""
    from kmgpu import stateful

    states = {id(v) for v in stateful.state_variables(model)}
    return [v for v in model.weights if id(v) not in states]


def copy_state(src, dst):
    """Copy weights, and optimizer state where ``src``'s optimizer has any, src -> dst."""
    src_w, dst_w = weights(src), weights(dst)
    if [tuple(v.shape) for v in src_w] != [tuple(v.shape) for v in dst_w]:
        raise ValueError(f"{dst.name}'s weights no longer match {src.name}'s.")
    for s, d in zip(src_w, dst_w):
        d.assign(keras.ops.convert_to_numpy(s.value))
    src_opt = getattr(src, "optimizer", None)
    dst_opt = getattr(dst, "optimizer", None)
    if src_opt is None or dst_opt is None or not src_opt.built:
        return
    if not dst_opt.built:
        dst_opt.build(dst.trainable_variables)
    src_vars, dst_vars = optimizer_state(src_opt), optimizer_state(dst_opt)
    if [tuple(v.shape) for v in src_vars] != [tuple(v.shape) for v in dst_vars]:
        return  # a different optimizer: keep dst's own state
    for s, d in zip(src_vars, dst_vars):
        d.assign(s.numpy())

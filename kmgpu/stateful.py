"""Stateful RNNs: fixed batches, per-replica state rows, ``rebatch``.

A stateful RNN layer keeps one state row per batch row, in untracked
non-trainable variables of shape (batch, units) (not in ``model.weights``, never
saved). State carries from row i of batch k to row i of batch k+1, so batches
are fixed: the global batch B is the model's own ``Input(batch_size=B)``, data
comes in whole batches, unshuffled, and replica r always owns rows
r*B/N ... (r+1)*B/N - 1.

The user's model (the template) holds the state between calls, like the
weights: engines copy it into their replicas' state rows before a call and back
after it. With ``reset_states="epoch"`` (the default) the states are zeroed at
the start of every epoch and of every evaluate / predict call.

Nothing here imports a backend at module import time.
"""

import warnings


def layers(model):
    """The stateful RNN layers of ``model`` (nested ones included), in order."""
    import keras

    return [layer for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.RNN) and layer.stateful]


def state_variables(model):
    """The state variables of every stateful RNN layer, flat, in layer order."""
    import keras

    return [v for layer in layers(model) if layer.states is not None
            for v in keras.tree.flatten(layer.states)]


def fixed_batch(model):
    """The batch size a stateful model was built for, or None for a stateless model."""
    variables = state_variables(model)
    return int(variables[0].shape[0]) if variables else None


def reset(model):
    """Zero every state row of ``model``."""
    for layer in layers(model):
        layer.reset_state()


def rebatch(model, batch_size):
    """A copy of a stateful model with another fixed batch size and the same weights.

    For example ``rebatch(model, 1)`` to predict one sequence step by step after
    training at batch 64. The copy is compiled like ``model`` (with a fresh
    optimizer) when ``model`` is compiled; its states start at zero.

    Args:
        model: a built Sequential or functional ``keras.Model``.
        batch_size: the new fixed batch size, an int >= 1.

    Returns:
        A new ``keras.Model``.
    """
    import keras

    from kmgpu import replicas

    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"rebatch(model, batch_size): batch_size must be an int >= 1, "
                        f"got {batch_size!r}.")
    if batch_size < 1:
        raise ValueError(f"rebatch(model, batch_size): batch_size must be >= 1, got {batch_size}.")
    if not isinstance(model, keras.Model):
        raise TypeError(f"rebatch(model, batch_size) takes a keras.Model, got "
                        f"{type(model).__name__}.")
    if not model.built:
        raise ValueError("rebatch(model, batch_size) needs a built model: give it a "
                         "keras.Input(batch_size=...) first.")
    if not _has_input(model):
        raise TypeError(
            f"rebatch needs a Sequential or functional model (its Input fixes the batch); "
            f"{type(model).__name__} is subclassed: create a new instance built for batch "
            f"{batch_size} and copy the weights with new.set_weights(model.get_weights())."
        )
    new = clone_at(model, batch_size)
    new.set_weights(model.get_weights())
    if model.compiled:
        new.compile(**replicas.compile_args(model))
    return new


def clone_at(model, batch_size):
    """An uncompiled copy of a Sequential / functional model built for ``batch_size``."""
    import keras

    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=(batch_size,) + tuple(t.shape[1:]), dtype=t.dtype),
        model.inputs[0] if isinstance(model, keras.Sequential) else model.input)
    return keras.models.clone_model(model, input_tensors=inputs)


def _has_input(model):
    import keras
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def check_split(model, num_replicas):
    """Raise unless a stateful model can be split into per-replica row blocks: a
    Sequential or functional model (re-created at B/N rows) whose B splits over N."""
    b, n = fixed_batch(model), num_replicas
    if b is not None and not _has_input(model):
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


def prepare_call(method, template, call, num_replicas, options, user_batch):
    """Check and adjust a fit / evaluate / predict call for a stateful ``template``.

    Batches are fixed (the model's own batch B, global), whole and unshuffled.

    Args:
        method: "fit", "evaluate" or "predict".
        template: the user's stateful model.
        call: the bound Keras arguments, batch sizes already global.
        num_replicas: N.
        options: the ParallelModel's ``plan.Options``.
        user_batch: the batch_size the user passed (None if left out).

    Returns:
        The call, with batch sizes filled in, shuffle off and, with
        ``options.drop_remainder``, the data cut to whole batches.

    Raises:
        ValueError: sizes that do not split, saying which would.
    """
    b = fixed_batch(template)
    n = num_replicas
    per_replica = options.batch == "per_replica"
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
            call[key] = _whole_batches(call[key], b, options.drop_remainder, key, method)
    validation = call.get("validation_data")
    if validation is not None:
        call["validation_data"] = tuple(
            _whole_batches(part, b, options.drop_remainder, "validation_data", method)
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


def reset_callback(model):
    """A Keras callback that zeroes ``model``'s states at the start of every epoch."""
    import keras

    class ResetStates(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            reset(model)

    return ResetStates()

"""A model class's own ``fit`` / ``evaluate`` / ``predict`` (and ``*_on_batch``) that does
work of its own, then calls ``keras.Model``'s: kmgpu runs it on your model, as plain
Keras does, and takes over where it calls ``keras.Model``'s method.

keras-hub's tasks (``CausalLM``, ``TextClassifier``...) are such models: their ``fit``
runs the task's preprocessor into a ``tf.data`` pipeline, then calls ``super().fit``
with it. kmgpu hands its engines that pipeline, and each replica runs Keras's own
method (``replication.keras_methods``), so the override runs once, on your model and
your preprocessor, whatever the engine.

Where the override calls ``super()``: ``super()`` follows the class's method order,
which a wrapper cannot enter from outside. For the duration of the call your model's
class is a subclass of its own (``_hooked``) with one more class, ``Hook``, just
before ``keras.Model`` in that order; ``Hook``'s methods put your model's class back
and run kmgpu's dispatch. Only your model is touched, only during the call, and its
class is its own again before any engine sees it.
"""

import functools
import inspect
import warnings

#: (model's id, method) -> kmgpu's dispatch for that call, while the override runs
_ROUTES = {}


def overrides(model, method):
    """Whether ``model``'s class defines ``method`` in place of ``keras.Model``'s."""
    import keras

    return getattr(type(model), method, None) is not getattr(keras.Model, method)


def run(model, method, args, kwargs, dispatch):
    """``type(model).<method>(model, *args, **kwargs)``, the user's own method, with its
    call of ``keras.Model.<method>`` answered by ``dispatch(args, kwargs)`` (kmgpu's).

    Returns:
        What the user's method returns. A method that never calls ``keras.Model``'s
        ran on one device as its own code: said once, in a warning.
    """
    own_class = type(model)
    key = (id(model), method)
    calls = []

    def through(a, k):
        calls.append(method)
        model.__class__ = own_class  # the engines see the model as it is
        try:
            return dispatch(a, k)
        finally:
            model.__class__ = hooked

    hooked = _hooked(own_class)
    _ROUTES[key] = through
    model.__class__ = hooked
    try:
        result = getattr(own_class, method)(model, *args, **kwargs)
    finally:
        model.__class__ = own_class
        _ROUTES.pop(key, None)
    if not calls:
        warnings.warn(
            f"kmgpu: {own_class.__name__}.{method} returned without calling "
            f"keras.Model.{method}: it ran as your own code, on one device. kmgpu takes "
            f"over where a model's own {method} calls super().{method}(...).",
            stacklevel=3)
    return result


def globalised(model, method, args, kwargs, globalise):
    """``args`` and ``kwargs`` of a call of ``model``'s own ``method`` with its
    ``batch_size`` (and ``validation_batch_size``) made global by ``globalise(call,
    keys)`` (the front's): the override batches the data with them before it calls
    ``keras.Model``'s method with datasets."""
    try:
        bound = inspect.signature(getattr(type(model), method)).bind(model, *args, **kwargs)
    except TypeError:
        return args, kwargs  # the method's own error, raised when it runs
    call = dict(bound.arguments)
    keys = [key for key in ("batch_size", "validation_batch_size") if key in call]
    if not keys:
        return args, kwargs
    done = globalise({key: call[key] for key in keys} | {"x": call.get("x")}, keys)
    for key in keys:
        bound.arguments[key] = done[key]
    return bound.args[1:], bound.kwargs


@functools.lru_cache(maxsize=None)
def _hooked(own_class):
    """``own_class`` with ``Hook`` just before ``keras.Model`` in its method order (the
    same name, module and behaviour otherwise)."""
    return type(own_class.__name__, (own_class, _hook_class()),
                {"__module__": own_class.__module__, "__qualname__": own_class.__qualname__})


@functools.lru_cache(maxsize=None)
def _hook_class():
    import keras

    from kmgpu.engines.replication import KERAS_METHODS

    def method(name):
        def answer(self, *args, **kwargs):
            route = _ROUTES.get((id(self), name))
            if route is None:  # another method's own call of keras.Model's: as Keras does
                return getattr(keras.Model, name)(self, *args, **kwargs)
            return route(args, kwargs)

        answer.__name__ = name
        return answer

    return type("Hook", (keras.Model,), {"__module__": __name__,
                                        **{name: method(name) for name in KERAS_METHODS}})

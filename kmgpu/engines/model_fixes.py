"""The model as Keras keeps it beside its config and weights: whether it is functional,
what its saving path writes for its layers (adapted preprocessing layers, lookup
vocabularies), its optimizer's settings outside ``get_config()``, and saving's cache and
serializer made safe for every process. Rows of ``kmgpu/engines/keras_fixes.py``.
"""

import sys

from kmgpu.engines import keras_fixes


def warm_saving():
    """Saving a model makes throw-away Keras objects once per type (an Optimizer, with
    a variable) to learn which attributes to skip. Made by process 0 alone inside
    fit (ModelCheckpoint), that variable would join a collective the other
    processes never enter: TensorFlow fails ("Collective instance ... expected
    type"), JAX asserts. Every process makes them here, outside any scope, and they
    are cached under the name Keras 3.15 looks them up by (it stores them as
    "saving_attr_skipset_*" but reads "saving_attr_skiplist_*", so its own cache
    never hits).
    """
    from keras.src.backend.common import global_state
    from keras.src.saving import saving_lib

    for kind in ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer",
                 "Loss"):
        global_state.set_global_attribute(f"saving_attr_skiplist_{kind}",
                                          saving_lib.get_attr_skipset(kind))


class _TensorflowIfImported:
    """Keras's lazy ``tensorflow`` module, "available" only once something imported it:
    before that, no object can be one of its types."""

    def __init__(self, lazy):
        self._lazy = lazy

    @property
    def available(self):
        return "tensorflow" in sys.modules and self._lazy.available

    def __getattr__(self, name):
        return getattr(self._lazy, name)


def serialize_without_tensorflow():
    """Keras's serializer (``get_config``, ``serialize_keras_object``) stops importing
    TensorFlow to ask whether an object is one of its types (see ``PATCHES``)."""
    from keras.src.saving import serialization_lib

    keras_fixes.install(serialization_lib, "tf", _TensorflowIfImported,
                        key="serialize_without_tensorflow")


def is_functional(model):
    """True for a Sequential or functional model (one whose Input fixes the batch)."""
    import keras
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def keeps_own_state(layer):
    """Whether ``layer`` holds state that its config and ``set_weights`` do not carry:
    Keras's preprocessing layers that are adapted (``finalize_state``, ``load_assets``:
    Normalization, Discretization, the lookups, TextVectorization) and a script's own
    layer that loads its variables its own way."""
    import keras

    own_load = (type(layer).load_own_variables is not keras.layers.Layer.load_own_variables
                and not (type(layer).__module__ or "").startswith("keras"))
    return hasattr(layer, "finalize_state") or hasattr(layer, "load_assets") or own_load


def own_state(model):
    """What Keras's saving path writes for ``model``'s layers (``save_own_variables``,
    ``save_assets``), as picklable NumPy data, or None when no layer keeps state beside
    its weights (``keeps_own_state``): then the config and the weights are all.

    The optimizer and the metrics are left out (the engines copy the optimizer's
    variables; a replica's metrics start at zero), and so is every layer that neither
    keeps such state nor holds one that does (``_not_layers``): their weights travel
    with the other weights, and walking them would copy every weight to the host at each
    call (ConvNeXtTiny with its Normalization layer: 112 MB per ``evaluate``).

    Returns:
        None or (weights: {path: {key: array}}, assets: nested dict of byte arrays or None).
    """
    from keras.src.saving import saving_lib

    if not any(keeps_own_state(layer) for layer in model._flatten_layers()):
        return None
    store = _Store()
    saving_lib._save_state(model, weights_store=store, assets_store=None, inner_path="",
                           visited_saveables=_not_layers(model))
    # the assets walk writes a folder per saveable of the whole model (it takes no skip
    # set): only where a layer has assets to save (vocabularies)
    assets = (saving_lib._save_assets_to_dict(model)
              if any(hasattr(layer, "save_assets") for layer in model._flatten_layers())
              else None)
    return store.contents, assets


def load_own_state(model, state):
    """Load ``own_state``'s data into ``model`` (same architecture) through Keras's own
    loading path: each layer's ``load_own_variables`` (Normalization finalizes its
    mean and variance there) and ``load_assets`` (vocabularies). Nothing for None."""
    from keras.src.saving import saving_lib

    if state is None:
        return
    weights, assets = state
    saving_lib._load_state(model, weights_store=_Store(weights), assets_store=None,
                           inner_path="", visited_saveables=_not_layers(model))
    saving_lib._load_assets_from_dict(model, assets)


def _not_layers(model):
    """ids of what ``own_state`` leaves out: the optimizer, the metrics, the losses, and
    the layers that neither keep own state nor hold a layer that does (the same on the
    template and on a replica of the same architecture, so saving and loading walk the
    same paths)."""
    skip = [getattr(model, "optimizer", None), getattr(model, "_compile_loss", None)]
    skip += list(getattr(model, "_metrics", []) or [])
    skip += [getattr(model, name, None) for name in ("_loss_tracker", "_compile_metrics")]
    skip += [layer for layer in model._flatten_layers(include_self=False)
             if not any(keeps_own_state(inner) for inner in layer._flatten_layers())]
    return {id(obj) for obj in skip if obj is not None}


def _store_class():
    from keras.src.saving import saving_lib

    class Store(saving_lib.NpzIOStore):
        """saving_lib's walk into a dict in memory: {path: {key: NumPy array}}."""

        def __init__(self, contents=None):  # no file
            self.contents, self.mode, self.archive = ({} if contents is None else contents,
                                                      "w", None)

        def make(self, path, metadata=None):
            return self.contents.setdefault(path or "__root__", _Arrays())

        def get(self, path):
            return dict(self.contents.get(path or "__root__", {}))

        def has_path(self, path):
            return (path or "__root__") in self.contents

    return Store


class _Arrays(dict):
    """One saveable's entries: values copied to NumPy as they are written."""

    def __setitem__(self, key, value):
        import keras
        import numpy as np

        if isinstance(value, keras.Variable):
            value = value.value
        super().__setitem__(key, np.array(keras.ops.convert_to_numpy(value)))


def _Store(contents=None):
    global _STORE
    if _STORE is None:
        _STORE = _store_class()
    return _STORE(contents)


_STORE = None


def save_weights_from(model, path, value_of, max_shard_size=None):
    """``model.save_weights(path, max_shard_size=...)``, Keras's own file (its paths, its
    sharded weights files with ``max_shard_size``), with each variable's array given by
    ``value_of(variable)`` (a NumPy array, or None: the variable's own value) at the
    moment Keras's walk writes it: a caller that maps each array only then (a
    ``kmgpu.ShardedCheckpoint``'s file) writes the file without a whole copy of the
    state, and ``model`` is left as it was."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.saving import saving_lib

    from kmgpu.engines import keras_fixes

    def substituting(store_class):
        class Substituting(store_class):
            def __setitem__(self, key, value):
                import keras

                found = value_of(value) if isinstance(value, keras.Variable) else None
                super().__setitem__(key, value if found is None else found)

        return Substituting

    def as_variables(save_own_variables):
        def save(self, store):  # the variables themselves, as a layer's own does
            for i, variable in enumerate(self.variables):
                store[str(i)] = variable

        return save

    with keras_fixes.swapped((saving_lib, "H5IOStore", substituting),
                             (saving_lib, "ShardedH5IOStore", substituting),
                             (BaseOptimizer, "save_own_variables", as_variables)):
        model.save_weights(path, max_shard_size=max_shard_size)


def optimizer_settings(model):
    """What ``model``'s optimizer holds outside ``get_config()``: the variables excluded
    from weight decay, as positions in ``model.trainable_variables``, and the compiled
    name pattern (``exclude_from_weight_decay``). None when there is none."""
    opt = getattr(model, "optimizer", None)
    opt = getattr(opt, "inner_optimizer", opt)  # a LossScaleOptimizer's (mixed_float16)
    keys = getattr(opt, "_exclude_from_weight_decay", None) or set()
    pattern = getattr(opt, "_exclude_from_weight_decay_pattern", None)
    if not keys and pattern is None:
        return None
    positions = [i for i, v in enumerate(model.trainable_variables) if opt._var_key(v) in keys]
    return {"exclude_positions": positions, "exclude_pattern": pattern}


def apply_optimizer_settings(model, settings):
    """Give ``model``'s (compiled, not yet built) optimizer ``optimizer_settings``."""
    opt = getattr(model, "optimizer", None)
    opt = getattr(opt, "inner_optimizer", opt)
    if settings is None or opt is None:
        return
    variables = model.trainable_variables
    opt.exclude_from_weight_decay(var_list=[variables[i] for i in
                                            settings["exclude_positions"]])
    opt._exclude_from_weight_decay_pattern = settings["exclude_pattern"]

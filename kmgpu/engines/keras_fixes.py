"""Keras internals every backend's engine uses, in one place.

Each entry of ``PATCHES`` names a Keras internal kmgpu reads or replaces, the Keras
version it was written against and the upstream issue it works around.
``tests/unit/test_keras_fixes.py`` imports every one, so moving the ``keras<3.16``
pin says at once what broke. Backend-specific ones live in
``kmgpu/engines/<backend>/keras_fixes.py``.
"""

KERAS = "3.15.1"

#: (module, attribute (dotted within the module), why)
PATCHES = [
    ("keras.src.saving.saving_lib", "get_attr_skipset",
     "saving's skip-set cache is stored as saving_attr_skipset_* but read as "
     "saving_attr_skiplist_* (Keras 3.15.1 saving_lib), so every save makes throw-away "
     "objects; kmgpu warms the cache under the name Keras reads"),
    ("keras.src.backend.common.global_state", "set_global_attribute",
     "where that cache lives"),
    ("keras.src.models.functional", "Functional",
     "no public class tells a functional model from a subclassed one"),
]


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


def is_functional(model):
    """True for a Sequential or functional model (one whose Input fixes the batch)."""
    import keras
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))

"""``model_fixes.own_state``: what travels beside the weights is the adapted layers'
state only. It is read at every kmgpu call (the replicas' identity), so walking every
layer made each ``evaluate`` copy all the weights to the host: ConvNeXtTiny (a
Normalization layer, 28M weights) evaluated 0.22x plain Keras on one H200."""

import keras
import numpy as np

from kmgpu.engines import replication
from kmgpu.engines import model_fixes


def _model():
    """An adapted Normalization inside a nested Sequential, beside big Dense layers."""
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(32, 4)).astype("float32")
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(x)
    inputs = keras.Input((4,))
    h = keras.Sequential([norm, keras.layers.Dense(3, name="inner")], name="pre")(inputs)
    h = keras.layers.Dense(512, name="wide")(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(h)), x


def test_only_adapted_layers_state_is_read():
    model, _ = _model()
    weights, _ = model_fixes.own_state(model)
    arrays = [a for entries in weights.values() for a in entries.values()]
    # Normalization keeps mean, variance (4 each) and a count: 9 numbers, not the 2,572
    # of the Dense layers' weights
    assert sum(np.asarray(a).size for a in arrays) == 9
    assert all("norm" in path for path, entries in weights.items() if entries)


def test_no_assets_walk_without_a_layer_that_has_assets(monkeypatch):
    """Keras's assets walk writes a folder per saveable of the whole model (0.4 s per call
    for EfficientNetB0 on this CPU): skipped when no layer has assets to save."""
    from keras.src.saving import saving_lib

    walked = []
    monkeypatch.setattr(saving_lib, "_save_assets_to_dict", lambda m: walked.append(m))
    model, _ = _model()
    assert model_fixes.own_state(model)[1] is None and walked == []


def test_a_replica_gets_the_adapted_state_through_the_nested_model():
    model, x = _model()
    replica = replication.clone(model)
    replica.set_weights(model.get_weights())
    replication.load_carried(replica, replication.carried(model))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(replica(x)),
                               keras.ops.convert_to_numpy(model(x)), rtol=1e-6, atol=1e-6)


class _Outer(keras.layers.Layer):
    """A layer that builds its sublayer in ``build``: the sublayer's first call is the
    model's first eager call (as in keras-hub's decoder blocks)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3)

    def build(self, shape):
        self.inner.build(shape)

    def call(self, x):
        return self.inner(x)

    def compute_output_shape(self, shape):
        return shape[:-1] + (3,)


def test_a_first_call_does_not_change_the_identity():
    """Layer.__call__ marks a layer called and records its caller's path; the engines
    keep their replicas and captured steps while the identity holds, so a change there
    made them all again at a model's second kmgpu call. A setting still counts."""
    model = keras.Sequential([keras.Input((4,)), _Outer(), keras.layers.Dropout(0.1)])
    before = replication.identity(model)
    model.predict(np.ones((2, 4), "float32"), verbose=0)
    assert replication.identity(model) == before
    model.layers[-1].rate = 0.2
    assert replication.identity(model) != before

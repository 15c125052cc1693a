"""With ``shard=`` the user's optimizer, built at the end of the first fit to receive the
replica's state (``host.built_on_host``), starts from the replica's own arrays, not from
whole zeros of every slot on the host: the copy back holds them next. A variable whose
array is not the one the copy back gives it starts from its initializer's value."""

import numpy as np

import kmgpu
from kmgpu.engines import replication
from kmgpu.engines.jax import host


def _model(optimizer):
    import keras

    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16),
                              keras.layers.Dense(8)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_first_sharded_fit_builds_the_users_optimizer_without_zeros(monkeypatch):
    import keras

    made, inside = [], []
    zeros, built_on_host = keras.initializers.Zeros.__call__, host.built_on_host

    def recording(self, shape, dtype=None):
        if inside:
            made.append(tuple(shape))
        return zeros(self, shape, dtype=dtype)

    def building(template, replica):
        inside.append(1)
        try:
            return built_on_host(template, replica)
        finally:
            inside.clear()

    model = _model("adam")
    parallel = kmgpu.parallelize(model, shard="weights")
    x = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    monkeypatch.setattr(keras.initializers.Zeros, "__call__", recording)
    monkeypatch.setattr(host, "built_on_host", building)
    assert not model.optimizer.built
    parallel.fit(x, x @ np.ones((4, 8), "float32"), batch_size=4, epochs=1, verbose=0)
    assert model.optimizer.built and made == []
    slots = [v for v in replication.optimizer_state(model.optimizer) if v.shape == (16, 8)]
    assert len(slots) == 2 and all(host.held(v) for v in slots)  # Adam's two moments


def test_a_variable_without_its_pair_starts_from_its_initializer():
    template, replica = _model("adam"), _model("sgd")
    replica.optimizer.build(replica.trainable_variables)  # other slots: no pairs
    host.built_on_host(template, replica)
    theirs = {id(v.value) for v in replica.optimizer.variables}
    for v in replication.optimizer_state(template.optimizer):
        assert id(host.current(v)) not in theirs, v.path
        if v.shape:  # Adam's moments start at zero
            assert not np.any(np.asarray(v.value)), v.path

"""Local BatchNorm on JAX (``sync_batchnorm=False``, the default), 4 simulated devices.

Each replica normalises with its own rows' moments, like BatchNormalization applied
to those rows on one device; the moving statistics are the mean over replicas of the
per-replica updates; the compiled train step all-reduces no BatchNorm moment.
``sync_batchnorm=True`` keeps the one-device result (tests/common/test_parity.py).
"""

import functools
import re

import numpy as np
import pytest

import kmgpu
from tests.helpers import few_steps, rel_diff

N = 4
COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def _net(k=1, seed=1):
    """k blocks Conv -> BatchNorm -> relu, then a Dense -> BatchNorm(axis=1) head."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 3))
    h = inputs
    for _ in range(k):
        h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization(momentum=0.9)(h)
        h = keras.layers.Activation("relu")(h)
    h = keras.layers.BatchNormalization(axis=1, momentum=0.8)(h)  # over rows of the image
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(5)(h)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 6, 6, 3)) * 2 + 0.5).astype("float32")
    return x, rng.normal(size=(n, 2)).astype("float32")


def _parallel(model, sync=False, optimizer="sgd"):
    parallel = kmgpu.parallelize(model, gpus=N, sync_batchnorm=sync)
    parallel.compile(optimizer=optimizer, loss="mse")
    return parallel


def _replica(parallel, x, y):
    """The engine's replica (kmgpu builds it at the first call)."""
    parallel.evaluate(x, y, batch_size=len(x), verbose=0)
    return parallel._engine.replica


def _sharded(parallel, *arrays):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    d = parallel._engine.distribution
    sharding = NamedSharding(d.device_mesh.backend_mesh, PartitionSpec(d.batch_dim_name))
    return [jax.device_put(a, sharding) for a in arrays]


_JITTED = {}  # id(model) -> (model, its jitted training call): one compile per model and shape


def _training_call(model, x):
    """(outputs, non-trainable values) of ``model(x, training=True)``, jitted (once per
    model: the calls on each replica's rows share the compiled program)."""
    import jax

    if id(model) not in _JITTED:
        def run(trainable, non_trainable, x):
            return model.stateless_call(trainable, non_trainable, x, training=True)

        _JITTED[id(model)] = (model, jax.jit(run))  # the model kept: its id stays its own
    outputs, non_trainable = _JITTED[id(model)][1](
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables], x)
    return np.asarray(outputs, dtype="float32"), [np.asarray(v) for v in non_trainable]


def _local_and_per_replica(parallel, model, x, y):
    """The replica's training call on the sharded batch, and the user's model on each
    replica's rows on one device: ((outputs, stats), [(outputs, stats) per replica])."""
    replica = _replica(parallel, x, y)
    with parallel._engine.scope():
        got = _training_call(replica, *_sharded(parallel, x))
    rows = len(x) // N
    return got, [_training_call(model, x[r * rows:(r + 1) * rows]) for r in range(N)]


def test_forward_equals_batchnorm_on_each_replicas_rows():
    """Training-mode outputs: BatchNorm over each replica's 8 rows, to float32 rounding;
    the moving statistics: the mean of the 4 per-replica updates."""
    x, y = _data()
    model = _net(k=2)
    parallel = _parallel(model)
    (got, got_stats), parts = _local_and_per_replica(parallel, model, x, y)
    assert "per replica" in parallel.describe()
    want, stats = [p[0] for p in parts], [p[1] for p in parts]
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-5, atol=2e-6)
    whole, _ = _training_call(model, x)
    assert np.abs(got - whole).max() > 1e-2, "these are the global moments, not local ones"
    assert len(_moving(model)) == len(got_stats) == 8
    for i in _moving(model):
        np.testing.assert_allclose(got_stats[i], np.mean([s[i] for s in stats], axis=0),
                                   rtol=1e-6, atol=1e-6)


def test_masked_inputs_use_each_replicas_unmasked_rows():
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    h = keras.layers.BatchNormalization()(h)
    model = keras.Model(inputs, keras.layers.LSTM(3)(h))
    rng = np.random.default_rng(1)
    x = rng.integers(0, 10, size=(16, 5)).astype("int32")
    x[:, 3:] = 0  # padding (masked out)
    y = rng.normal(size=(16, 3)).astype("float32")
    parallel = _parallel(model)
    (got, got_stats), parts = _local_and_per_replica(parallel, model, x, y)
    np.testing.assert_allclose(got, np.concatenate([p[0] for p in parts]), rtol=1e-5, atol=2e-6)
    for i in _moving(model):
        np.testing.assert_allclose(got_stats[i], np.mean([p[1][i] for p in parts], axis=0),
                                   rtol=1e-6, atol=1e-6)


def _moving(model):
    """Indices of the moving statistics among ``model.non_trainable_variables``."""
    return [i for i, v in enumerate(model.non_trainable_variables) if "moving_" in v.path]


def _mean_of_replica_steps(x, y, **net):
    """One plain SGD step per replica's rows on one device, each from the same start; the
    mean of the weights (the moving statistics among them). One model serves every
    replica's step, its weights set back to the start before each (its compiled step
    reused: a model per replica would compile 4 times); plain SGD keeps no state but its
    step count, which its update does not read."""
    import keras

    rows, results = len(x) // N, []
    ref = _net(**net)
    ref.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    start = ref.get_weights()
    for r in range(N):
        ref.set_weights(start)
        ref.fit(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows], batch_size=rows,
                epochs=1, shuffle=False, verbose=0)
        results.append(ref.get_weights())
    return [np.mean(ws, axis=0) for ws in zip(*results)]


_FITTED = {}  # sync -> the ParallelModel (k = 1) test_a_fit_step trained: its replica
# serves _train_step_collectives(1, sync)


def test_a_fit_step_equals_the_mean_of_per_replica_steps():
    """Gradient mean and moving statistics: the mean over replicas."""
    x, y = _data()
    model = _net()
    parallel = _FITTED[False] = _parallel(model)
    with few_steps():
        parallel.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    want = _mean_of_replica_steps(x, y)
    assert rel_diff(want, model.get_weights()) <= 1e-5
    names = [w.path for w in model.weights]
    moving = [i for i, n in enumerate(names) if "moving_" in n]
    assert len(moving) == 6
    for i in moving:
        np.testing.assert_allclose(model.get_weights()[i], want[i], rtol=1e-6, atol=1e-6)
    # and not the global batch's (sync_batchnorm=True): the mean of the replicas' means
    # is the global mean, but their variances miss the spread between replicas
    synced = _net()
    _FITTED[True] = _parallel(synced, sync=True)
    with few_steps():
        _FITTED[True].fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    assert rel_diff(synced.get_weights(), want) > 1e-3
    variances = [i for i in moving if "moving_variance" in names[i]]
    assert max(np.abs(synced.get_weights()[i] - want[i]).max() for i in variances) > 1e-4

    # inference uses the moving statistics, as on one device
    np.testing.assert_allclose(parallel.predict(x, batch_size=len(x), verbose=0),
                               model.predict(x, batch_size=len(x), verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_a_batch_the_devices_do_not_divide_uses_the_whole_batch():
    """30 rows on 4 devices: kmgpu places the batch replicated, so each device's
    moments are the whole batch's, and the step equals one device's."""
    import keras

    x, y = _data(30)
    ref = _net()
    ref.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    ref.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    model = _net()
    with few_steps():
        _parallel(model).fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= 1e-5


def test_mixed_precision():
    import keras

    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = _net()
        parallel = _parallel(model)
        (got, got_stats), parts = _local_and_per_replica(parallel, model, x, y)
        with few_steps():
            parallel.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(str(v.dtype) == "float32" for v in model.non_trainable_variables)
    want = np.concatenate([p[0] for p in parts])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # bfloat16 activations
    for i in _moving(model):  # the statistics are float32 throughout
        np.testing.assert_allclose(got_stats[i], np.mean([p[1][i] for p in parts], axis=0),
                                   rtol=1e-2, atol=1e-2)


# -- the compiled train step: where the collectives are ---------------------------------
@functools.lru_cache(maxsize=None)
def _train_step_collectives(k, sync):
    """The op_name of every cross-device collective in the replica's compiled train step
    (made once per (k, sync): both cases compare with k = 1's; for k = 1 the replica of
    test_a_fit_step's ParallelModel, already made, where that test ran first)."""
    import jax

    x, y = _data()
    parallel = _FITTED.get(sync) if k == 1 else None
    if parallel is None:
        parallel = _parallel(_net(k=k), sync=sync)
        _replica(parallel, x, y)
    replica = parallel._engine.replica
    with parallel._engine.scope():
        if not replica.optimizer.built:
            replica.optimizer.build(replica.trainable_variables)
        state = tuple([v.value for v in variables] for variables in (
            replica.trainable_variables, replica.non_trainable_variables,
            replica.optimizer.variables, replica.metrics_variables))
        text = jax.jit(replica.train_step).lower(
            state, tuple(_sharded(parallel, x, y))).compile().as_text()
    found = []
    for line in text.splitlines():
        if COLLECTIVE.search(line):
            name = re.search(r'op_name="([^"]*)"', line)
            found.append(name.group(1) if name else "?")
    return tuple(found)


def _moments(names):
    """Collectives that reduce a BatchNorm moment: every layer's moments come from
    jnp.var (Keras's and kmgpu's alike), forward and backward."""
    return [n for n in names if "batch_normalization" in n and "jit(_var)" in n]


@pytest.mark.parametrize("k", [1, 3])
def test_no_collective_inside_local_batchnorm(k):
    """k conv blocks (k + 2 BatchNorm layers). Local: the only collectives are the
    gradient / loss / moving-statistics all-reduces, which do not wait on each other
    (XLA combines them: their number does not grow with k); no moment is all-reduced.
    Sync: the moments of every layer are all-reduced, forward and backward, one after
    the other (>= 2 per layer more)."""
    layers = k + 2
    local, sync = _train_step_collectives(k, False), _train_step_collectives(k, True)
    assert _moments(local) == [], local
    assert len(local) == len(_train_step_collectives(1, False)) <= 2, local
    assert any("kmgpu_replica_mean" in n for n in local)  # the moving statistics' mean
    assert len(_moments(sync)) >= 2 * layers, sync
    assert len(sync) >= len(local) + 2 * layers, (local, sync)

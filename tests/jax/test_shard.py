"""``shard="gradients"`` (ZeRO-2) and ``shard="weights"`` (ZeRO-3 / FSDP) on JAX
(``kmgpu/engines/jax/zero.py``, ``host.py``): gradients, then weights too, lie 1/N on each
device, the user's model keeps its whole state in host memory, and training equals one
device.

One tiny model carries BatchNormalization (``sync_batchnorm=True``: the one-device
arithmetic), an Embedding and a parameter count no device count divides (135): tokens
(3 of a vocabulary of 8) -> Embedding(8, 4) -> Flatten -> Dense(6, no bias: BatchNorm
undoes it) -> BatchNorm -> Dense(1).
On 4 devices the embedding table and the (12, 6) kernel shard, the vectors of 6 and the
(6, 1) kernel stay whole; on 2 those vectors shard too. Batch 16; one case has a last
partial batch (``CASES``).

A covering matrix, one fit per optimizer case, each on one (shard value, N) pair so that
each shard value meets N=2 and N=4; the one-device fits are shared. The other tests read
those fits (``_SHARDED``). Across processes: tests/jax/test_launch.py.
"""

import functools
import warnings

import numpy as np
import pytest

import kmgpu
from tests.helpers import optimizer_state, rel_diff

TOL = 1e-5
BATCH, VOCAB = 16, 8
#: float16 arithmetic: the order of float16 sums, as in tests/jax/test_zero.py
FLOAT16_TOL = 1e-3

#: case -> (shard value, devices (a list: the mesh, gpus=), rows). The gradients case on
#: devices 2 and 3 keeps device 0, the host, out of the mesh, so where the user's model
#: keeps its arrays can be told from the mesh. 69 rows: a last batch of 5, which 4 devices
#: do not divide (kmgpu runs it replicated, sharded weights gathered), in fit, evaluate and
#: predict; 64: none (one compile less per fit).
CASES = {
    "sgd_momentum": ("gradients", [2, 3], 64),
    "adamw_exclusions_global_clipnorm_schedule": ("weights", 4, 69),
    "adam_mixed_float16": ("gradients", 4, 64),
    "adam_save_load": ("weights", 2, 64),
}


def _model():
    import keras

    keras.utils.set_random_seed(4)
    return keras.Sequential([
        keras.Input((3,), dtype="int32"), keras.layers.Embedding(VOCAB, 4),
        keras.layers.Flatten(), keras.layers.Dense(6, use_bias=False),
        keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
        keras.layers.Dense(1)])


def _data(name):
    rows = CASES[name][2]
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(rows, 3)).astype("int32")
    y = (np.sin(x).sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(rows, 1)))
    return x, y.astype("float32")


def _optimizer(name):
    import keras

    o = keras.optimizers
    if name == "sgd_momentum":
        return o.SGD(0.05, momentum=0.9)
    if name.startswith("adamw"):
        opt = o.AdamW(o.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5),
                      weight_decay=0.3, global_clipnorm=0.05)
        opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
        return opt
    return o.Adam(0.02)  # mixed_float16: compile wraps it in a LossScaleOptimizer


def _fit(name, gpus=None, epochs=2, model=None, callbacks=None):
    """(model, target, history): plain Keras on one device when ``gpus`` is None, else
    kmgpu with the case's shard value."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16" if "float16" in name
                                            else "float32")
    try:
        model = model or _model()
        x, y = _data(name)
        target = model if gpus is None else kmgpu.parallelize(
            model, gpus=gpus, shard=CASES[name][0], sync_batchnorm=True)
        if not model.compiled:
            target.compile(optimizer=_optimizer(name), loss="mse")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="kmgpu: only")  # 5 steps per epoch
            history = target.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                                 verbose=0, callbacks=callbacks)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, target, history


_SHARDED = {}  # case -> (model, ParallelModel, history) of test_equals_one_device


@functools.cache
def _reference(name):
    return _fit(name)


def _assert_same(model, losses, ref, ref_losses, tol=TOL):
    assert rel_diff(ref.get_weights(), model.get_weights()) <= tol
    assert [v.shape for v in model.optimizer.variables] == \
        [v.shape for v in ref.optimizer.variables]
    assert rel_diff(optimizer_state(ref), optimizer_state(model)) <= (
        10 * tol if tol > TOL else tol)
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)


def _host():
    import jax

    return jax.local_devices(backend="cpu")[0]


class _TemplateWhere:
    """A callback noting the devices the user's model's arrays are on at each step."""

    def __new__(cls, model):
        import keras

        class Watch(keras.callbacks.Callback):
            seen = set()

            def on_train_batch_end(self, batch, logs=None):
                for v in model.weights + model.optimizer.variables:
                    Watch.seen |= {str(d) for d in v.value.devices()}

        return Watch()


def _sharded(name):
    if name not in _SHARDED:
        test_equals_one_device(name)
    return _SHARDED[name]


@pytest.mark.parametrize("name", [n for n in CASES if n != "adam_save_load"])
def test_equals_one_device(name):
    """Weights, History and the optimizer's variables equal one device's; evaluate and
    predict too with the weights sharded; the user's model holds its whole state on the
    host, also while it trains."""
    import jax

    ref, _, ref_history = _reference(name)
    model, gpus = None, CASES[name][1]
    watch = None
    if isinstance(gpus, list):  # the user's model built on an accelerator outside the mesh
        model = _model()
        for v in model.weights:
            v.assign(jax.device_put(v.value, jax.devices()[1]))
        watch = _TemplateWhere(model)
    model, parallel, history = _fit(name, gpus, model=model,
                                    callbacks=[watch] if watch else None)
    _SHARDED[name] = (model, parallel, history)
    tol = FLOAT16_TOL if "float16" in name else TOL
    _assert_same(model, history.history["loss"], ref, ref_history.history["loss"], tol)
    if CASES[name][0] == "weights":  # sharded weights: evaluate and predict gather them
        x, y = _data(name)
        assert rel_diff([ref.predict(x, batch_size=BATCH, verbose=0)],
                        [parallel.predict(x, batch_size=BATCH, verbose=0)]) <= tol
        np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                                   ref.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=tol)
    if watch is not None:  # never a whole copy on the devices that train
        assert watch.seen == {str(_host())}, watch.seen
    for v in model.weights + model.optimizer.variables:  # the whole state, on the host
        assert v.value.devices() == {_host()} and v.value.sharding.is_fully_replicated


def test_save_load_and_a_second_fit_continue_exactly(tmp_path):
    """shard="weights" on 2 devices: after one epoch the user's model saves its whole
    state and load_model gives it back exactly; a second fit continues as two epochs on
    one device."""
    import keras

    name = "adam_save_load"
    ref, _, ref_history = _reference(name)
    model, parallel, first = _fit(name, CASES[name][1], epochs=1)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    assert rel_diff(model.get_weights(), loaded.get_weights()) == 0
    assert rel_diff(optimizer_state(model), optimizer_state(loaded)) == 0
    x, y = _data(name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kmgpu: only")
        second = parallel.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _SHARDED[name] = (model, parallel, second)
    _assert_same(model, first.history["loss"] + second.history["loss"], ref,
                 ref_history.history["loss"])


def _split(shape, n):
    return next((i for i, d in enumerate(shape) if d >= n and d % n == 0), None)


@pytest.mark.parametrize("name", ["adam_mixed_float16", "adamw_exclusions_global_clipnorm_schedule"])
def test_gradients_are_constrained_to_one_nth(name):
    """Inside the train step each gradient is constrained to its slot's layout: sharded
    where a dimension splits over N, else left alone."""
    _, parallel, _ = _sharded(name)
    replica = parallel._engine.replica
    specs = replica.optimizer.constrained
    assert len(specs) == len(replica.trainable_variables)
    for v, spec in zip(replica.trainable_variables, specs):
        i = _split(v.shape, 4)
        assert (spec is None) == (i is None), (v.path, spec)
        if i is not None:
            assert spec[i] == "batch", (v.path, spec)


def test_weights_lie_one_nth_on_each_device_and_slots_follow():
    """shard="weights" on 4 devices: every weight a dimension of which 4 divides is
    sharded there (the embedding table, the (12, 6) kernel), the rest whole; the
    optimizer's slots with them; bytes per device from the arrays' shards."""
    from kmgpu.engines import replication
    from kmgpu.engines.jax import zero

    name = "adamw_exclusions_global_clipnorm_schedule"
    _, parallel, _ = _sharded(name)
    replica = parallel._engine.replica
    weights = replication.weights(replica)
    state = replication.optimizer_state(replica.optimizer)
    for v in weights + state:
        i = _split(v.shape, 4)
        spec = tuple(v.value.sharding.spec)
        assert ("batch" in spec) == (i is not None), (v.path, v.shape, spec)
    assert sum("batch" in tuple(v.value.sharding.spec) for v in weights) == 2
    per, whole, kept = zero.measured_bytes(weights)
    assert (per, whole, kept) == zero.planned_bytes(weights, 4)
    assert whole == 135 * 4 and per == (whole - kept) // 4 + kept
    engine = parallel._engine
    assert engine.sharded_bytes(parallel.model, "weights") == (per, whole, kept)
    assert engine.sharded_bytes(parallel.model, "gradients") == \
        zero.planned_bytes(replica.trainable_variables, 4)
    assert engine.sharded_bytes(parallel.model, "optimizer") == zero.measured_bytes(state)
    line = [x for x in parallel.describe().splitlines() if "memory/device" in x][0]
    assert line.count("(1/4 of") == 3 and "shard='weights'" in line, line


def test_gradients_keep_the_weights_whole_on_each_device():
    """shard="gradients" on 4 devices: weights whole on every device, slots sharded."""
    _, parallel, _ = _sharded("adam_mixed_float16")
    replica = parallel._engine.replica
    assert all(v.value.sharding.is_fully_replicated for v in replica.weights)
    assert any(not v.value.sharding.is_fully_replicated for v in replica.optimizer.variables)
    assert parallel._engine.sharded_bytes(parallel.model, "weights") is None


def test_the_optimizer_state_is_gathered_when_read():
    """shard="weights": after a fit the user's optimizer variables hold the replica's sharded
    arrays themselves (no whole copy on the host); a read gathers one whole onto the host,
    equal to the replica's; read from a callback during the next fit, it is the replica's
    state at that step; the fit after it holds them again."""
    import keras

    from kmgpu.engines import replication
    from kmgpu.engines.jax import host

    model = _model()
    parallel = kmgpu.parallelize(model, gpus=4, shard="weights")
    parallel.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    x, y = _data("adam_save_load")
    kwargs = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kmgpu: only")
        parallel.fit(x, y, **kwargs)
    replica = parallel._engine.replica
    pairs = list(zip(replication.optimizer_state(model.optimizer),
                     replication.optimizer_state(replica.optimizer)))
    held = [(t, r) for t, r in pairs if host.held(t)]
    assert len(held) == 4  # the moments of the embedding table and the (12, 6) kernel
    for t, r in held:  # the same buffers: no copy
        assert [s.data.unsafe_buffer_pointer() for s in host.current(t).addressable_shards] \
            == [s.data.unsafe_buffer_pointer() for s in r.value.addressable_shards]
    assert not any(host.held(t) for t, r in pairs if r.value.sharding.is_fully_replicated)
    t, r = held[0]
    value = t.value  # gathered
    assert not host.held(t) and value.devices() == {_host()}
    np.testing.assert_array_equal(np.asarray(value), np.asarray(r.value))

    t, r = held[1]
    seen = []

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # the user's model, then the replica at this step
                mine = np.asarray(t.value)
                assert self.model is replica  # (the read syncs its variables)
                seen.append((mine, np.asarray(r.value)))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kmgpu: only")
        parallel.fit(x, y, callbacks=[Read()], **kwargs)
    np.testing.assert_array_equal(*seen[0])
    assert all(host.held(t) for t, _ in held), [(t.path, type(t), host.held(t)) for t, _ in held]

"""train_on_batch / test_on_batch / predict_on_batch on every replica:
the rows of each batch are split over the replicas (also batches the device count does
not divide, and smaller than it), the results equal one device, the user's model holds
the current weights after every call, and a loop copies nothing in while the model is
unchanged -- but does see what the user changed between calls.

4 simulated devices, an MLP, batches of 6 and 3 rows (and 8 where a loop repeats: there
``FEW`` devices, as what is copied in is the same on any count).
"""

import warnings

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

TOL = 1e-5
SIZES = (6, 3)  # splits 2,2,1,1 and 1,1,1,0 over 4 replicas


def _keras():
    import keras

    return keras


#: 2 devices on TensorFlow (half the tracing of 4); JAX and torch keep 4 (torch's pool of 4
#: workers serves the whole file)
FEW = 2 if _keras().backend.backend() == "tensorflow" else 4


def _pair(gpus=None):
    """A plain one-device model and a kmgpu model (on ``gpus``, default all 4) from the
    same initial weights."""
    ref, model = mlp(), mlp()
    for m in (ref, model):
        m.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return ref, model, kmgpu.parallelize(model, gpus=gpus)


def _state(model):
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


def _record_rows(parallel, function):
    """Each replica's rows of the batch the next ``function`` call runs, as the replica's
    step receives them (torch: as each rank reports them)."""
    keras = _keras()
    engine = parallel._engine
    if keras.backend.backend() == "torch":
        return lambda: engine.rank_rows
    replica, seen = engine.replica, []
    original = getattr(replica, function)

    def recording(*args):
        batch = next(iter(args[-1]))
        x = keras.tree.flatten(batch)[0]
        if keras.backend.backend() == "jax":
            seen.append([int(s.data.shape[0]) for s in x.addressable_shards])
        else:
            seen.append([int(p.shape[0]) for p in
                         engine.strategy.experimental_local_results(x)])
        return original(*args[:-1], [batch] if isinstance(args[-1], list) else iter([batch]))

    setattr(replica, function, recording)
    return lambda: seen[-1]


def _expected_rows(n, replicas=4):
    keras = _keras()
    if keras.backend.backend() == "jax" and n % replicas:
        return [n] * replicas  # kmgpu's JAX places such a batch replicated (see engine)
    return [len(b) for b in np.array_split(np.arange(n), replicas)]


def test_a_train_on_batch_loop_splits_the_rows_and_equals_one_device():
    x, y = data("mlp", 64)
    ref, model, parallel = _pair()
    lo, rows = 0, None
    for n in SIZES * 2:
        want = ref.train_on_batch(x[lo:lo + n], y[lo:lo + n])
        got = parallel.train_on_batch(x[lo:lo + n], y[lo:lo + n])
        if rows is None:  # the replica exists now: watch what its steps receive
            rows = _record_rows(parallel, "train_function")
        else:
            assert rows() == _expected_rows(n), n
        np.testing.assert_allclose(got, want, rtol=TOL)
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL  # after every call
        lo += n
    assert int(model.optimizer.iterations.numpy()) == 2 * len(SIZES)
    assert rel_diff(_state(ref), _state(model)) <= TOL  # the optimizer state too
    got = parallel.train_on_batch(x[:6], y[:6], return_dict=True)
    want = ref.train_on_batch(x[:6], y[:6], return_dict=True)
    assert sorted(got) == sorted(want) == ["loss", "mae"]
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=TOL)


def test_test_and_predict_on_batch_split_the_rows_and_equal_one_device():
    x, y = data("mlp", 32)
    ref, model, parallel = _pair()
    parallel.test_on_batch(x[:6], y[:6])  # the replica exists now
    tested = _record_rows(parallel, "test_function")
    parallel.predict_on_batch(x[:6])
    predicted = _record_rows(parallel, "predict_function")
    for n in SIZES:
        got = parallel.test_on_batch(x[:n], y[:n], return_dict=True)
        assert tested() == _expected_rows(n)
        want = ref.test_on_batch(x[:n], y[:n], return_dict=True)
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=TOL)
        out = parallel.predict_on_batch(x[8:8 + n])
        assert predicted() == _expected_rows(n)
        assert out.shape == (n, 1)  # every row once, in order
        np.testing.assert_allclose(out, ref.predict_on_batch(x[8:8 + n]), rtol=TOL, atol=1e-6)


def test_a_loop_copies_nothing_in_until_the_user_changes_the_model():
    x, y = data("mlp", 64)
    ref, model, parallel = _pair(gpus=FEW)
    engine = parallel._engine
    for m in (ref, parallel):
        m.train_on_batch(x[:8], y[:8])
    for m in (ref, parallel):
        m.train_on_batch(x[8:16], y[8:16])
    assert engine.copied_in == 0  # the replicas kept the state the last call left
    parallel.predict_on_batch(x[:8])
    parallel.test_on_batch(x[:8], y[:8])
    assert engine.copied_in == 0
    # the user changes the model between calls: the next call starts from that
    new = [w * 0.5 for w in ref.get_weights()]
    ref.set_weights(new)
    model.set_weights(new)
    kernel = model.layers[0].kernel
    kernel.assign(kernel.numpy() + 0.25)  # Keras's own variable API
    ref.layers[0].kernel.assign(ref.layers[0].kernel.numpy() + 0.25)
    for m in (ref, parallel):
        m.train_on_batch(x[16:24], y[16:24])
    assert engine.copied_in > 0
    assert rel_diff(_state(ref), _state(model)) <= TOL
    # ... and fit after a loop of them, and a loop after fit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few steps per epoch
        for m in (ref, parallel):
            m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(_state(ref), _state(model)) <= TOL
    for m in (ref, parallel):
        m.train_on_batch(x[:6], y[:6])
    assert engine.copied_in == 0
    assert rel_diff(_state(ref), _state(model)) <= TOL


def test_a_stateful_model_is_refused_up_front_and_left_untouched():
    keras = _keras()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6, 3), batch_size=8),
                              keras.layers.LSTM(4, stateful=True), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    parallel = kmgpu.parallelize(model)
    before = model.get_weights()
    x, y = data("lstm", 8)
    for call in (lambda: parallel.train_on_batch(x, y), lambda: parallel.test_on_batch(x, y),
                 lambda: parallel.predict_on_batch(x)):
        with pytest.raises(ValueError, match="stateful RNN layers is not supported"):
            call()
    assert rel_diff(before, model.get_weights()) == 0.0
    assert not model.optimizer.built

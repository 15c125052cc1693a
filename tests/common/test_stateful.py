"""Stateful RNNs through kmgpu: state carries batch to batch, row to row, on 1 and 4
devices; training equals one device (Adam on 4 devices, SGD on ``FEW``); a task only state
can solve is learned; rebatch.

The tests share fits and ParallelModels where they can. On TensorFlow a fit's cost is
its tracing (about twice as much on 4 devices as on 2), not its epochs: ``FEW`` devices
serve where 4 add nothing specific, 4 where they do (state rows per replica, 2 each; a
batch that does not split).

The data of a stateful model is laid out as Keras expects it: batch k holds chunk k
of the same B sequences, so row i of batch k continues in row i of batch k+1.
"""

import functools
import warnings
from contextlib import nullcontext

import keras
import numpy as np
import pytest

import kmgpu
from kmgpu.engines import replication
from tests.helpers import few_steps, one_device, rel_diff

B, CHUNK, CHUNKS, FEATURES = 8, 3, 4, 2
#: 2 devices on TensorFlow; torch keeps 4 (its pool of 4 workers serves the whole file, a
#: pool of 2 would start besides), and so does JAX (4 cost it no more than 2)
FEW = 2 if keras.backend.backend() == "tensorflow" else 4


def make(cell="LSTM", batch=B, steps=CHUNK, is_stateful=True, seed=1, units=5):
    keras.utils.set_random_seed(seed)
    layer = getattr(keras.layers, cell)(units, stateful=is_stateful)
    inputs = keras.Input(batch_shape=(batch, steps, FEATURES))
    if cell == "GRU":  # functional as well as Sequential
        return keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    return keras.Sequential([inputs, layer, keras.layers.Dense(1)])


def chunked(sequences, chunk=CHUNK):
    """(B, T, F) sequences -> (T/chunk * B, chunk, F): batch k = chunk k of every sequence."""
    t = sequences.shape[1]
    return np.concatenate([sequences[:, k:k + chunk] for k in range(0, t, chunk)])


def sequences(n=B, steps=CHUNK * CHUNKS, seed=0):
    return np.random.default_rng(seed).normal(size=(n, steps, FEATURES)).astype("float32")


@functools.lru_cache(maxsize=None)
def _unchunked(cell):
    """What a ``cell`` model of ``make``'s weights should give, made once per cell for
    its 1- and 4-device cases: (weights, the stateless model's predict over all 12 steps,
    the state rows that calling the stateful model directly on the 4 chunks leaves)."""
    seqs = sequences()
    whole = make(cell, batch=None, steps=CHUNK * CHUNKS, is_stateful=False)
    ref = whole.predict(seqs, verbose=0)
    direct = make(cell)
    direct.set_weights(whole.get_weights())
    for k in range(CHUNKS):
        direct(chunked(seqs)[k * B:(k + 1) * B])
    expect = keras.ops.convert_to_numpy(replication.state_variables(direct)[0].value)
    return whole.get_weights(), ref, expect


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "SimpleRNN"])
@pytest.mark.parametrize("gpus", [1, 4])
def test_state_carries_from_chunk_to_chunk(cell, gpus):
    seqs = sequences()
    weights, ref, expect = _unchunked(cell)
    model = make(cell)
    model.set_weights(weights)
    with one_device() if gpus == 1 else nullcontext():
        parallel = kmgpu.parallelize(model, gpus=gpus)
    out = parallel.predict(chunked(seqs), batch_size=B, verbose=0)
    assert out.shape == (B * CHUNKS, 1)
    carried = np.abs(out[-B:] - ref).max()
    print(f"{cell} on {gpus}: last chunk vs stateless over 12 steps: {carried:.2e}")
    assert carried <= 1e-5
    assert np.abs(out[:B] - ref).max() > 1e-2  # the first chunk alone is not the answer
    # the user's model holds the state rows afterwards, replica by replica
    state = keras.ops.convert_to_numpy(replication.state_variables(model)[0].value)
    np.testing.assert_allclose(state, expect, atol=1e-5)


def _stateful_data():
    seqs = sequences(n=B * 2, seed=3)  # two groups of 8 sequences: 8 batches per epoch
    x = np.concatenate([chunked(seqs[:B]), chunked(seqs[B:])])
    return x, np.tanh(x.sum(axis=(1, 2)))[:, None].astype("float32")


def _fit(gpus, optimizer, epochs=2, **options):
    x, y = _stateful_data()
    model = make("LSTM", seed=5)
    before = [w.copy() for w in model.get_weights()]
    with one_device() if gpus == 1 else nullcontext():
        parallel = kmgpu.parallelize(model, gpus=gpus, **options)
    rate = {"SGD": 0.05, "Adam": 0.01}[optimizer]
    parallel.compile(optimizer=getattr(keras.optimizers, optimizer)(rate), loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = parallel.fit(x, y, batch_size=B, epochs=epochs, verbose=0)
    return model, before, history, parallel


_FITS = {}


def _fit_once(gpus, optimizer):
    """``_fit(gpus, optimizer)`` (2 epochs), made once per module: the rebatch test starts
    from the 4-device Adam model that the parity test trained (and predicts with its
    ParallelModel)."""
    if (gpus, optimizer) not in _FITS:
        _FITS[gpus, optimizer] = _fit(gpus, optimizer)
    return _FITS[gpus, optimizer]


#: devices per optimizer: the optimizer's update is the same code on 2 devices as on 4;
#: state rows per replica on 4 devices (2 rows each) are Adam's case
PARITY_GPUS = {"SGD": FEW, "Adam": 4}


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_training_on_several_devices_equals_one_device(optimizer):
    gpus = PARITY_GPUS[optimizer]
    one, before, h1, p1 = _fit_once(1, optimizer)
    many, _, hn, pn = _fit_once(gpus, optimizer)
    moved = max(rel_diff(a, b) for a, b in zip(one.get_weights(), before))
    worst = max(rel_diff(a, b) for a, b in zip(many.get_weights(), one.get_weights()))
    print(f"stateful LSTM {optimizer}, 2 epochs: moved {moved:.3f}, {gpus} vs 1 device "
          f"{worst:.2e}")
    assert moved > 1e-2
    assert worst <= 1e-5
    np.testing.assert_allclose(hn.history["loss"], h1.history["loss"], rtol=1e-5)
    x, y = _stateful_data()
    e1, en = p1.evaluate(x, y, verbose=0), pn.evaluate(x, y, verbose=0)
    pred = pn.predict(x, verbose=0)
    print(f"evaluate: 1 device {e1:.6f}, {gpus} devices {en:.6f}")
    assert en == pytest.approx(e1, rel=1e-5)
    assert en == pytest.approx(float(np.mean((pred - y) ** 2)), rel=1e-5)


def test_a_task_only_state_can_solve_is_learned_with_state_only():
    """Each sequence is two chunks of one step: a value, then a blank; the target of both
    chunks is the value, so at chunk 2 only the state can know it. Without state no
    training gets below var(U(-1, 1)) = 1/3 at chunk 2 (the blank is the same input for
    every row, so the prediction is one constant): that model trains 2 epochs (its mse
    there 0.374-0.378 on every backend; 0.360-0.367 after 10 to 40 epochs). With state,
    4 groups of 32 sequences (8 batches an epoch), Adam(0.05) for 20 epochs (Adam(0.03)
    took 40 for the same): mse at chunk 2 after 15 / 20 epochs 0.025 / 0.021 (JAX),
    0.032 / 0.035 (torch), 0.026 / 0.023 (TensorFlow), against the 0.07 that the ratio
    below allows (6 groups, 12 batches an epoch, gave 0.004-0.022 after 20 epochs at
    1.5 times the steps). ``FEW`` devices: training equals one device's, so the figures
    are those of any device count."""
    b, groups = 32, 4
    rng = np.random.default_rng(0)
    first = rng.uniform(-1, 1, size=(groups, b, 1, 1)).astype("float32")
    second = np.zeros((groups, b, 1, 1), "float32")
    x = np.concatenate([np.concatenate([f, s]) for f, s in zip(first, second)])
    y = np.concatenate([np.concatenate([f[:, 0], f[:, 0]]) for f in first])
    recall = np.concatenate([np.arange(b, 2 * b) + 2 * b * g for g in range(groups)])

    losses = {}
    for is_stateful in (True, False):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input(batch_shape=(b, 1, 1)),
                                  keras.layers.LSTM(8, stateful=is_stateful),
                                  keras.layers.Dense(1)])
        parallel = kmgpu.parallelize(model, gpus=FEW)
        parallel.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel.fit(x, y, batch_size=b, epochs=20 if is_stateful else 2, verbose=0)
        pred = parallel.predict(x, batch_size=b, verbose=0)
        losses[is_stateful] = float(np.mean((pred[recall] - y[recall]) ** 2))
    ratio = losses[False] / losses[True]
    print(f"recall chunk 1 at chunk 2: mse with state {losses[True]:.4f}, without "
          f"{losses[False]:.4f}, ratio {ratio:.1f}")
    assert losses[False] > 0.2  # var(U(-1, 1)) = 1/3: nothing learned without state
    assert ratio > 5


def test_rebatch_to_one_keeps_the_weights_and_predicts_step_by_step():
    seqs = sequences()
    model, _, _, parallel = _fit_once(4, "Adam")
    batched = parallel.predict(chunked(seqs), batch_size=B, verbose=0)
    single = kmgpu.rebatch(model, 1)
    assert replication.fixed_batch(single) == 1 and single.compiled
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with one_device():
        step = kmgpu.parallelize(single, gpus=1, reset_states=None)
    row = 5  # sequence 5, one chunk per call: the state carries between calls
    outs = [step.predict(seqs[row:row + 1, k:k + CHUNK], verbose=0) for k in range(0, 12, CHUNK)]
    np.testing.assert_allclose(np.concatenate(outs)[:, 0], batched[row::B, 0], atol=1e-5)
    step.reset_states()
    again = step.predict(seqs[row:row + 1, :CHUNK], verbose=0)
    np.testing.assert_allclose(again, outs[0], atol=1e-6)


def test_states_reset_each_epoch_or_never_and_are_not_saved(tmp_path):
    """``FEW`` devices: resetting or keeping the state rows is the same code on any
    count."""
    x = chunked(sequences())
    model = make()
    parallel = kmgpu.parallelize(model, gpus=FEW)
    first = parallel.predict(x, batch_size=B, verbose=0)
    np.testing.assert_allclose(parallel.predict(x, batch_size=B, verbose=0), first, atol=1e-6)
    keep = kmgpu.parallelize(model, gpus=FEW, reset_states=None)
    keep.reset_states()
    np.testing.assert_allclose(keep.predict(x, batch_size=B, verbose=0), first, atol=1e-6)
    carried = keep.predict(x, batch_size=B, verbose=0)  # starts from the last call's state
    assert np.abs(carried - first).max() > 1e-3
    path = tmp_path / "stateful.keras"
    keep.save(path)
    loaded = keras.saving.load_model(path)
    assert len(loaded.weights) == len(model.weights)  # states are not weights
    states = replication.state_variables(loaded)
    assert np.abs(keras.ops.convert_to_numpy(states[0].value)).max() == 0


def test_sizes_that_do_not_fit_say_what_would():
    x = chunked(sequences())
    y = np.zeros((len(x), 1), "float32")
    six = make(batch=6)
    weights = [w.copy() for w in six.get_weights()]
    with pytest.raises(ValueError, match=r"does not split over 4 replicas.*gpus=3"):
        kmgpu.parallelize(six, gpus=4)
    model = make()  # the checks below are of batches, not replicas: FEW devices
    parallel = kmgpu.parallelize(model, gpus=FEW)
    parallel.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"fixed batch of 8.*batch_size=8.*rebatch"):
        parallel.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"30 samples, not a multiple.*first 24.*drop_remainder"):
        parallel.fit(x[:30], y[:30], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="validation_data"):
        parallel.fit(x, y, batch_size=8, validation_split=0.25, verbose=0)
    for a, b in zip(six.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    with pytest.warns(UserWarning, match="shuffle=False"), few_steps():
        parallel.fit(x, y, verbose=0)  # batch_size from the model, shuffle turned off
    tail = kmgpu.parallelize(model, gpus=FEW, drop_remainder=True)
    assert tail.predict(x[:30], verbose=0).shape == (24, 1)

"""TensorFlow: fit's training arrays kept across calls (``kept_input``). A loop
of ``fit`` calls on the same arrays reads one distributed iterator instead of making one
per call; each call must still train on exactly the batches plain Keras trains on, on one
device, with the same calls: the same rows in the same order, a fresh pass per call.

Each test makes every call twice, kmgpu on several devices and plain Keras on one, and
compares the weights after each call. The last batch of a pass has fewer rows than there
are devices, so an iterator read from the wrong place gives other batches: 46 rows in
batches of 4 on 4 devices (12 steps, the last of 2 rows) for the first test; the others,
whose calls are the same on any device count, 45 rows on 2 devices (the last batch of 1
row), which trace in about half the time.
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

BATCH, TOL = 4, 1e-5
ROWS = {4: 46, 2: 45}  # devices -> rows: the last batch, 2 or 1 rows, has fewer than them


def _pair(seed=3, optimizer="adam", gpus=2):
    """(plain Keras model on one device, kmgpu's ParallelModel on ``gpus`` of the same
    initial weights), compiled alike."""
    reference = mlp(seed)
    reference.compile(optimizer=optimizer, loss="mse")
    parallel = kmgpu.parallelize(mlp(seed), gpus=gpus)
    parallel.compile(optimizer=optimizer, loss="mse")
    return reference, parallel


def _both(reference, parallel, *args, **kwargs):
    """The same fit on both; the kmgpu model's weights must equal plain Keras's after."""
    kwargs.setdefault("verbose", 0)
    plain = reference.fit(*args, **kwargs)
    ours = parallel.fit(*args, **kwargs)
    assert rel_diff(reference.get_weights(), parallel.model.get_weights()) <= TOL
    np.testing.assert_allclose(ours.history["loss"], plain.history["loss"], rtol=1e-5)
    return ours


def _live(parallel):
    """The distributed iterator kmgpu keeps for the next fit (None: none kept)."""
    slot = parallel._engine._kept["fit"]._slot
    return slot[0] if slot else None


def test_repeated_fits_read_one_iterator_and_equal_plain_keras():
    """Three fit(epochs=1) calls, then a fit(epochs=2) with validation arrays, on
    unchanged training arrays: the weights and losses equal plain Keras's after each
    call, and all four calls read the one iterator the first call made. 4 devices."""
    x, y = data("mlp", ROWS[4])
    vx, vy = data("mlp", 10, seed=1)
    reference, parallel = _pair(gpus=4)
    iterators = []
    for epochs in (1, 1, 1, 2):
        history = _both(reference, parallel, x, y, batch_size=BATCH, epochs=epochs,
                        shuffle=False, validation_data=(vx, vy) if epochs == 2 else None)
        iterators.append(_live(parallel))
    np.testing.assert_allclose(history.history["val_loss"],
                               reference.history.history["val_loss"], rtol=1e-5)
    assert iterators[0] is not None and all(it is iterators[0] for it in iterators)


def test_a_changed_input_is_not_reused():
    """x changed in place, a new y of equal values, other class weights, another batch
    size: each call trains on what it is given (equal to plain Keras), and only the call
    whose arrays and settings equal the last call's keeps its iterator. (Class weights
    in every call: one input signature, one trace.)"""
    x, y = data("mlp", ROWS[2])
    labels = (y > np.median(y)).astype("float32")  # class weights weigh rows by label
    reference, parallel = _pair(seed=4)

    def fit(y, weights, batch=BATCH):
        _both(reference, parallel, x, y, batch_size=batch, shuffle=False,
              class_weight=weights)
        return _live(parallel)

    first = fit(labels, {0: 1.0, 1: 3.0})
    x[5, 2] += 1.0  # in place: the same object, other values
    second = fit(labels, {0: 1.0, 1: 3.0})
    assert first is not None and second is not first
    assert fit(labels.copy(), {0: 1.0, 1: 3.0}) is second  # equal values: kept
    third = fit(labels, {0: 1.0, 1: 0.5})
    assert third is not second
    assert fit(labels, {0: 1.0, 1: 0.5}, BATCH - 1) is not third


def test_shuffled_fits_keep_plain_keras_order():
    """shuffle=True under a global seed: plain Keras's new pipeline per call draws its
    first permutation again at every call. kmgpu feeds the arrays in that permutation
    (read once), unshuffled, so the calls read one kept iterator and each gives plain
    Keras's weights."""
    x, y = data("mlp", ROWS[2])
    reference, parallel = _pair(seed=5, optimizer="sgd")
    iterators = []
    for _ in range(3):
        keras.utils.set_random_seed(11)
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=True, verbose=0)
        keras.utils.set_random_seed(11)
        parallel.fit(x, y, batch_size=BATCH, epochs=1, shuffle=True, verbose=0)
        assert rel_diff(reference.get_weights(), parallel.model.get_weights()) <= TOL
        iterators.append(_live(parallel))
    assert iterators[0] is not None and all(it is iterators[0] for it in iterators)


class _StopAfter(keras.callbacks.Callback):
    """Ends the fit after ``steps`` batches: by ``stop_training``, or by raising."""

    def __init__(self, steps, raises=False):
        super().__init__()
        self.steps, self.raises = steps, raises

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.steps:
            if self.raises:
                raise RuntimeError("stop here")
            self.model.stop_training = True


@pytest.mark.parametrize("raises", [False, True], ids=["stop_training", "raised"])
def test_a_call_that_stopped_mid_pass_leaves_the_next_at_a_pass_start(raises):
    """A fit stopped after 5 of 12 batches (a callback's stop_training, or an error):
    the next fit starts at the first batch of a pass, as plain Keras's new iterator does
    (a kept iterator would go on from batch 6)."""
    x, y = data("mlp", ROWS[2])
    reference, parallel = _pair(seed=6, optimizer="sgd")
    _both(reference, parallel, x, y, batch_size=BATCH, shuffle=False)
    kept = _live(parallel)
    for model in (reference, parallel):
        try:
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                      callbacks=[_StopAfter(5, raises)])
        except RuntimeError:
            assert raises
    assert rel_diff(reference.get_weights(), parallel.model.get_weights()) <= TOL
    assert _live(parallel) is None
    _both(reference, parallel, x, y, batch_size=BATCH, shuffle=False)
    assert _live(parallel) not in (None, kept)


class _StopEvaluating(keras.callbacks.Callback):
    """Ends an evaluate after ``steps`` batches (``stop_evaluating``)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_test_batch_end(self, batch, logs=None):
        if batch + 1 == self.steps:
            self.model.stop_evaluating = True


def test_repeated_evaluate_and_predict_read_one_iterator_each(monkeypatch):
    """evaluate and predict on unchanged arrays: every call gives plain Keras's scores and
    predictions, every row in order (the last batch of 1 row on 2 devices), and the
    calls after the first make no new ``MultiDeviceIterator``; other arrays make a new
    one, and an evaluate stopped mid-pass leaves the next one at the first batch."""
    from tests.tensorflow.test_per_call_counts import Counts

    x, y = data("mlp", ROWS[2])
    reference, parallel = _pair(seed=7)
    reference.compile(optimizer="adam", loss="mse", metrics=["mae"])
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])

    def both(x, y, **kwargs):
        plain = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                                   **kwargs)
        ours = parallel.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True,
                                 **kwargs)
        assert sorted(ours) == sorted(plain)
        for key, value in plain.items():
            np.testing.assert_allclose(ours[key], value, rtol=1e-6, err_msg=key)
        predicted = parallel.predict(x, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(predicted, reference.predict(x, batch_size=BATCH,
                                                                verbose=0), rtol=1e-6)
        assert len(predicted) == len(x)

    both(x, y)
    kept = {m: parallel._engine._kept[m]._slot[0] for m in ("evaluate", "predict")}
    counts = Counts(monkeypatch, parallel)
    for _ in range(3):
        both(x, y)
    assert counts.iterators == 0
    assert all(parallel._engine._kept[m]._slot == [it] for m, it in kept.items())
    other = x.copy()
    other[-1, 0] += 1.0  # the last row, alone in the last batch
    both(other, y)
    assert counts.iterators == 2  # one each for evaluate and predict
    for model in (reference, parallel):
        model.evaluate(other, y, batch_size=BATCH, verbose=0, callbacks=[_StopEvaluating(3)])
    assert parallel._engine._kept["evaluate"]._slot == []
    both(other, y)  # from the first batch again: plain Keras's scores
    assert counts.iterators == 3

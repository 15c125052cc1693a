"""Faults inside fit, on every backend: an interruption keeps the progress made
(weights and optimizer state of one consistent point), TerminateOnNaN and EarlyStopping
stop every replica together, and BackupAndRestore resumes an interrupted fit to the
weights of an uninterrupted one.

48 samples, global batch 8: 6 steps per epoch; 2 devices (cheap on TensorFlow).
"""

import functools
import tempfile
import time
import warnings

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

TOL = 1e-5
DEVICES = 2
KW = dict(batch_size=8, shuffle=False, verbose=0)


def _keras():
    import keras

    return keras


def _interrupt_at(epoch, batch, error):
    """A callback that raises ``error`` after step ``batch`` of epoch ``epoch``."""
    keras = _keras()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, b, logs=None):
            if self.epoch == epoch and b == batch:
                raise error

    return Interrupt()


def _parallel(optimizer="adam"):
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, kmgpu.parallelize(model, gpus=DEVICES)


def _fit(fitter, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fitter.fit(*args, **dict(KW, **kwargs))


def _state(model):
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


@functools.lru_cache(maxsize=None)
def _plain_steps():
    """optimizer.iterations -> weights + optimizer state after that step, in plain Keras:
    one epoch (step 6), and a fit interrupted where kmgpu's is below (step 9: the same
    state whichever error stops it). Made once for both kinds of interruption."""
    x, y = data("mlp", 48)
    steps = {}
    for stop in (None, KeyboardInterrupt()):
        ref = mlp()
        ref.compile(optimizer="adam", loss="mse")
        try:
            _fit(ref, x, y, epochs=1 if stop is None else 3,
                 callbacks=[] if stop is None else [_interrupt_at(1, 2, stop)])
        except KeyboardInterrupt:
            pass
        steps[int(ref.optimizer.iterations.numpy())] = _state(ref)
    return steps


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("callback failed")],
                         ids=["ctrl-c", "callback-error"])
def test_interrupted_in_epoch_2_keeps_one_consistent_point(error):
    """The user's model holds the weights and Adam state of one step of the uninterrupted
    run: the step where fit stopped (TF, JAX) or the last epoch end (torch workers), never
    the start and never a mix."""
    x, y = data("mlp", 48)
    steps = _plain_steps()
    assert sorted(steps) == [6, 9]
    model, parallel = _parallel()
    with pytest.raises(type(error)):
        _fit(parallel, x, y, epochs=3, callbacks=[_interrupt_at(1, 2, error)])
    k = int(model.optimizer.iterations.numpy())
    assert k in (6, 9), k  # the end of epoch 1, or step 3 of epoch 2 where it stopped
    assert rel_diff(steps[k], _state(model)) <= TOL
    _fit(parallel, x, y, epochs=1)  # and the next fit runs from there
    assert int(model.optimizer.iterations.numpy()) == k + 6


def test_terminate_on_nan_stops_every_replica_at_the_same_step():
    keras = _keras()
    x, y = data("mlp", 48)
    ref, _ = _parallel(keras.optimizers.SGD(1e18))
    want = _fit(ref, x, y, epochs=5, callbacks=[keras.callbacks.TerminateOnNaN()])
    model, parallel = _parallel(keras.optimizers.SGD(1e18))
    start = time.monotonic()
    got = _fit(parallel, x, y, epochs=5, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert time.monotonic() - start < 30
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == 2
    assert got.epoch == want.epoch == [0]
    assert not np.isfinite(got.history["loss"][0])


def test_early_stopping_stops_every_replica_and_restores_the_best_weights():
    keras = _keras()
    x, y = data("mlp", 48)

    def stop():  # no epoch improves by 1e9: stop after epoch 2, restore epoch 1's weights
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=1,
                                             restore_best_weights=True)

    ref, _ = _parallel()
    want = _fit(ref, x, y, epochs=20, callbacks=[stop()])
    model, parallel = _parallel()
    start = time.monotonic()
    got = _fit(parallel, x, y, epochs=20, callbacks=[stop()])
    assert time.monotonic() - start < 60
    assert got.epoch == want.epoch == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == 12
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL  # epoch 1's, restored


def test_backup_and_restore_resumes_an_interrupted_fit_exactly():
    """Interrupted in epoch 2, re-run with the same backup directory: the weights of an
    uninterrupted 3-epoch run, and the resumed fit runs epochs 2 and 3 only."""
    keras = _keras()
    x, y = data("mlp", 48)
    ref, _ = _parallel()
    _fit(ref, x, y, epochs=3)
    model, parallel = _parallel()
    with tempfile.TemporaryDirectory() as backup:
        with pytest.raises(KeyboardInterrupt):
            _fit(parallel, x, y, epochs=3, callbacks=[
                keras.callbacks.BackupAndRestore(backup), _interrupt_at(1, 2, KeyboardInterrupt())])
        history = _fit(parallel, x, y, epochs=3,
                       callbacks=[keras.callbacks.BackupAndRestore(backup)])
    diff = rel_diff(ref.get_weights(), model.get_weights())
    print(f"BackupAndRestore: rel. diff to the uninterrupted run {diff:.2e}")
    assert diff <= TOL
    assert history.epoch == [1, 2]
    assert int(model.optimizer.iterations.numpy()) == 18

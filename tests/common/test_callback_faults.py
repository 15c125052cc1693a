"""An exception or KeyboardInterrupt from any callback hook leaves the user's model where
plain Keras leaves it, on every backend; on torch the worker pool
survives it and the next fit works.

80 samples, global batch 8 (10 steps per epoch), validation data of 16 rows, 2 devices.
One kmgpu model and one plain Keras model serve every case: both are reset to the same
initial weights and a fresh optimizer state before each.
"""

import numpy as np
import pytest

import kmgpu
from kmgpu.engines import replication
from tests.helpers import data, mlp, rel_diff

TOL = 1e-5
KW = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)

#: (hook, when it raises: f(epoch, index)), one case per hook; fit's test hooks run
#: during its validation, evaluate's and predict's in their own calls
CASES = [
    ("fit", "on_train_begin", lambda e, i: True),
    ("fit", "on_epoch_begin", lambda e, i: e == 1),
    ("fit", "on_train_batch_begin", lambda e, i: e == 0 and i == 2),
    ("fit", "on_train_batch_end", lambda e, i: e == 0 and i == 2),
    ("fit", "on_train_batch_end", lambda e, i: e == 1 and i == 4),
    ("fit", "on_epoch_end", lambda e, i: e == 0),
    ("fit", "on_test_begin", lambda e, i: e == 1),
    ("fit", "on_test_batch_end", lambda e, i: e == 0 and i == 0),
    ("fit", "on_train_end", lambda e, i: True),
    ("evaluate", "on_test_batch_end", lambda e, i: i == 1),
    ("predict", "on_predict_batch_begin", lambda e, i: i == 1),
]


def _raising(hook, when, error):
    """A callback raising ``error`` from ``hook`` when ``when(epoch, index)``."""
    import keras

    class Raise(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if hook == "on_epoch_begin" and when(epoch, None):
                raise error

    def raise_(self, *args, **kwargs):
        index = args[0] if args and isinstance(args[0], int) else None
        if when(self.epoch, index):
            raise error

    if hook != "on_epoch_begin":
        setattr(Raise, hook, raise_)
    return Raise()


def _state(model):
    return model.get_weights() + [v.numpy() for v in replication.optimizer_state(model.optimizer)]


def _reset(model, weights):
    model.set_weights(weights)
    for v in replication.optimizer_state(model.optimizer):
        v.assign(np.zeros(v.shape, v.dtype))


def _call(fitter, method, x, y, vx, vy, callbacks):
    if method == "fit":
        return fitter.fit(x, y, validation_data=(vx, vy), callbacks=callbacks, **KW)
    if method == "evaluate":
        return fitter.evaluate(vx, vy, batch_size=8, verbose=0, callbacks=callbacks)
    return fitter.predict(vx, batch_size=8, verbose=0, callbacks=callbacks)


#: an exception takes the path of KeyboardInterrupt (torch: the driver aborts every rank
#: at that hook): a few hooks suffice for it
SOME = [CASES[3], CASES[10]]


def test_a_callback_raising_from_any_hook_leaves_the_model_where_plain_keras_does():
    x, y = data("mlp", 80)
    vx, vy = data("mlp", 16, seed=3)
    ref, model = mlp(), mlp()
    initial = ref.get_weights()
    for m in (ref, model):
        m.compile(optimizer="adam", loss="mse")
        m.optimizer.build(m.trainable_variables)
    parallel = kmgpu.parallelize(model, gpus=2)
    pids = None
    # one kmgpu model for all (on TensorFlow a second one, made after the first had
    # been interrupted, ran its fits ~15x slower in this process)
    for error, method, hook, when in ([(KeyboardInterrupt,) + c for c in CASES]
                                      + [(RuntimeError,) + c for c in SOME]):
        for m in (ref, model):
            _reset(m, initial)
        before = _state(model)
        for fitter in (ref, parallel):
            with pytest.raises(error):
                _call(fitter, method, x, y, vx, vy, [_raising(hook, when, error("stop"))])
        case = f"{error.__name__} in {method}'s {hook}"
        steps = int(ref.optimizer.iterations.numpy())
        assert int(model.optimizer.iterations.numpy()) == steps, case
        # evaluate and predict change no weights (plain Keras on JAX loses its model's
        # variables when their callbacks raise: Keras purges them without a finally)
        want = _state(ref) if method == "fit" else before
        assert rel_diff(want, _state(model)) <= TOL, case
        if hasattr(parallel._engine, "worker_pids"):  # torch: the same pool throughout
            pids = pids or parallel._engine.worker_pids()
            assert parallel._engine.worker_pids() == pids, case
    _reset(ref, initial)
    _reset(model, initial)
    for fitter in (ref, parallel):  # and the next fit runs
        fitter.fit(x, y, **dict(KW, epochs=1))
    assert rel_diff(_state(ref), _state(model)) <= TOL

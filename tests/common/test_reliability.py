"""Reliability: bad input is refused before anything runs, with an error that
says what to do, and the user's model stays byte-identical; a property test over sizes,
device counts and batch policies.

The catalogue is a table, one line per bad input. To add a case, append a line to
CATALOGUE (or to a list of your own that you add to it):

    Bad("where-what", lambda t: <the bad call>, ErrorType, r"regex the message matches"),

``t`` is the module's ``Target``: ``t.model`` (the user's model: compiled with Adam and
trained once, so its optimizer has state), ``t.parallel`` (that model on 4 devices),
``t.x`` / ``t.y`` (40 samples, 5 features), ``t.nan(a)`` (a copy with one NaN) and
``t.fresh()`` (a new built, uncompiled model). The test checks the exception type and
message, that ``t.model``'s weights, config, compile config and optimizer state are
unchanged, and that no worker process was started or stopped.
"""

import json
import warnings

import numpy as np
import pytest

import kmgpu
from kmgpu.engines import replication
from tests.helpers import children, data, mlp

# -- the catalogue --------------------------------------------------------------------


class Bad:
    def __init__(self, id, call, error, match):
        self.id, self.call, self.error, self.match = id, call, error, match

    def __repr__(self):
        return self.id


def _keras():
    import keras

    return keras


CATALOGUE = [
    # simulate_devices
    Bad("simulate-zero", lambda t: kmgpu.simulate_devices(0), ValueError, r"int >= 1"),
    Bad("simulate-str", lambda t: kmgpu.simulate_devices("4"), TypeError, r"int >= 1"),
    Bad("simulate-bool", lambda t: kmgpu.simulate_devices(True), TypeError, r"int >= 1"),
    Bad("simulate-after-start", lambda t: kmgpu.simulate_devices(2), RuntimeError,
        r"Call kmgpu.simulate_devices\(2\) first"),
    # parallelize
    Bad("parallelize-none", lambda t: kmgpu.parallelize(None), TypeError, r"needs a keras.Model"),
    Bad("parallelize-layer", lambda t: kmgpu.parallelize(_keras().layers.Dense(2)), TypeError,
        r"Wrap your layer in keras.Sequential"),
    Bad("parallelize-twice", lambda t: kmgpu.parallelize(t.parallel), TypeError,
        r"needs a keras.Model"),
    # an unbuilt Sequential is built from the first batch (tests/common/test_dropin.py);
    # an unbuilt subclassed model cannot be
    Bad("parallelize-unbuilt",
        lambda t: kmgpu.parallelize(_unbuilt_subclassed()),
        ValueError, r"needs a built Dense2: call model\(x\) once, or model.build"),
    Bad("parallelize-gpus-too-many", lambda t: kmgpu.parallelize(t.fresh(), gpus=5), ValueError,
        r"Pass gpus=None to use all"),
    Bad("parallelize-gpus-duplicate", lambda t: kmgpu.parallelize(t.fresh(), gpus=[1, 1]),
        ValueError, r"list each id once"),
    Bad("parallelize-gpus-dict", lambda t: kmgpu.parallelize(t.fresh(), gpus={"second": 1}),
        ValueError, r"name the device that holds the model"),
    Bad("parallelize-gpus-float", lambda t: kmgpu.parallelize(t.fresh(), gpus=2.0), TypeError,
        r"None, an int, a list of ids"),
    Bad("parallelize-batch-policy", lambda t: kmgpu.parallelize(t.fresh(), batch="local"),
        ValueError, r"pass batch='global'"),
    Bad("parallelize-warmup-negative",
        lambda t: kmgpu.parallelize(t.fresh(), batch="per_replica", warmup_epochs=-1),
        ValueError, r"pass 0 \(no warm-up\)"),
    Bad("parallelize-warmup-unscaled", lambda t: kmgpu.parallelize(t.fresh(), warmup_epochs=2),
        ValueError, r"Pass scale_lr=True"),
    # compile
    Bad("compile-optimizer", lambda t: t.parallel.compile(optimizer="adamm", loss="mse"),
        ValueError, r"pass a name such as 'adam'"),
    Bad("compile-loss", lambda t: t.parallel.compile(optimizer="adam", loss="mean_sq"),
        ValueError, r"does not know 'mean_sq'. Pass a loss name"),
    Bad("compile-metric",
        lambda t: t.parallel.compile(optimizer="adam", loss="mse", metrics=["acuracy"]),
        ValueError, r"Pass a metric name"),
    Bad("compile-loss-type", lambda t: t.parallel.compile(optimizer="adam", loss=3), TypeError,
        r"Pass a loss name"),
    Bad("compile-keyword", lambda t: t.parallel.compile(optimiser="adam", loss="mse"),
        TypeError, r"takes the arguments of keras.Model.compile"),
    Bad("compile-steps-per-execution",
        lambda t: t.parallel.compile(optimizer="adam", loss="mse", steps_per_execution=0),
        ValueError, r"pass an int >= 1"),
    # fit
    Bad("fit-uncompiled", lambda t: kmgpu.parallelize(t.fresh(), gpus=2).fit(t.x, t.y),
        ValueError, r"call parallel.compile\(optimizer=..., loss=...\)"),
    Bad("fit-keyword", lambda t: t.parallel.fit(t.x, t.y, epochz=2), TypeError,
        r"takes the arguments of keras.Model.fit"),
    Bad("fit-batch-zero", lambda t: t.parallel.fit(t.x, t.y, batch_size=0), ValueError,
        r"pass an int >= 1"),
    Bad("fit-batch-float", lambda t: t.parallel.fit(t.x, t.y, batch_size=2.5), TypeError,
        r"pass an int >= 1"),
    Bad("fit-epochs-negative", lambda t: t.parallel.fit(t.x, t.y, epochs=-1), ValueError,
        r"pass an int >= 1"),
    Bad("fit-epochs-str", lambda t: t.parallel.fit(t.x, t.y, epochs="3"), TypeError,
        r"pass an int >= 1"),
    Bad("fit-initial-epoch", lambda t: t.parallel.fit(t.x, t.y, epochs=2, initial_epoch=3),
        ValueError, r"Pass epochs > 3"),
    Bad("fit-steps-zero", lambda t: t.parallel.fit(t.x, t.y, steps_per_epoch=0), ValueError,
        r"pass an int >= 1"),
    Bad("fit-xy-lengths", lambda t: t.parallel.fit(t.x, t.y[:30]), ValueError,
        r"x: 40, y: 30: pass one row per sample"),
    Bad("fit-sample-weight-length",
        lambda t: t.parallel.fit(t.x, t.y, sample_weight=np.ones(10)), ValueError,
        r"sample_weight: 10: pass one row per sample"),
    Bad("fit-features", lambda t: t.parallel.fit(t.x[:, :4], t.y), ValueError,
        r"pass an array of shape \(samples, 5\)"),
    Bad("fit-rank", lambda t: t.parallel.fit(t.x[:, 0], t.y), ValueError,
        r"pass an array of shape \(samples, 5\)"),
    Bad("fit-empty", lambda t: t.parallel.fit(t.x[:0], t.y[:0]), ValueError,
        r"pass at least one sample"),
    Bad("fit-x-none", lambda t: t.parallel.fit(None, t.y), ValueError, r"pass the input data"),
    Bad("fit-x-filename", lambda t: t.parallel.fit("train.npy", t.y), TypeError,
        r"load the file first"),
    Bad("fit-x-list-of-floats", lambda t: t.parallel.fit([0.5] * 40, t.y), TypeError,
        r"pass np.asarray"),
    Bad("fit-x-strings", lambda t: t.parallel.fit(t.x.astype(str), t.y), TypeError,
        r"convert it to numbers"),
    Bad("fit-nan-x", lambda t: t.parallel.fit(t.nan(t.x), t.y), ValueError,
        r"x holds NaN values in 1 of 40 rows \(first: row 7\).*drop those rows"),
    Bad("fit-inf-y", lambda t: t.parallel.fit(t.x, t.y * np.inf), ValueError,
        r"y holds inf values in 40 of 40 rows.*fill them in"),
    Bad("fit-nan-sample-weight",
        lambda t: t.parallel.fit(t.x, t.y, sample_weight=t.nan(np.ones(40))), ValueError,
        r"sample_weight holds NaN"),
    Bad("fit-validation-split-range",
        lambda t: t.parallel.fit(t.x, t.y, validation_split=1.5), ValueError,
        r"pass a fraction in \[0, 1\)"),
    Bad("fit-validation-split-empty",
        lambda t: t.parallel.fit(t.x, t.y, validation_split=0.99), ValueError,
        r"leaves 0 of 40 samples for training.*at least one sample on each side"),
    Bad("fit-validation-data-form",
        lambda t: t.parallel.fit(t.x, t.y, validation_data=(t.x,)), ValueError,
        r"must be \(x_val, y_val\)"),
    Bad("fit-validation-data-nan",  # its labels; its x, like evaluate's, is not scanned
        lambda t: t.parallel.fit(t.x, t.y, validation_data=(t.x, t.nan(t.y))), ValueError,
        r"validation y holds NaN"),
    Bad("fit-validation-data-features",
        lambda t: t.parallel.fit(t.x, t.y, validation_data=(t.x[:, :3], t.y)), ValueError,
        r"validation x has per-sample shape \(3,\)"),
    Bad("fit-callback-class",
        lambda t: t.parallel.fit(t.x, t.y, callbacks=[_keras().callbacks.EarlyStopping]),
        TypeError, r"instantiate it"),
    Bad("fit-callbacks-not-list", lambda t: t.parallel.fit(t.x, t.y, callbacks="early"),
        TypeError, r"pass e.g. callbacks=\[keras.callbacks.EarlyStopping\(\)\]"),
    Bad("fit-shuffle", lambda t: t.parallel.fit(t.x, t.y, shuffle="yes"), TypeError,
        r"pass True, False or 'batch'"),
    Bad("fit-verbose", lambda t: t.parallel.fit(t.x, t.y, verbose=3), ValueError,
        r"pass 'auto', 0"),
    Bad("fit-class-weight", lambda t: t.parallel.fit(t.x, t.y, class_weight=[1.0, 2.0]),
        TypeError, r"must be a dict"),
    # evaluate
    Bad("evaluate-batch-zero", lambda t: t.parallel.evaluate(t.x, t.y, batch_size=0),
        ValueError, r"pass an int >= 1"),
    Bad("evaluate-xy-lengths", lambda t: t.parallel.evaluate(t.x[:39], t.y), ValueError,
        r"x: 39, y: 40"),
    Bad("evaluate-features", lambda t: t.parallel.evaluate(t.x[:, :2], t.y), ValueError,
        r"pass an array of shape \(samples, 5\)"),
    Bad("evaluate-nan-y", lambda t: t.parallel.evaluate(t.x, t.nan(t.y)), ValueError,
        r"y holds NaN"),
    Bad("evaluate-steps", lambda t: t.parallel.evaluate(t.x, t.y, steps=-1), ValueError,
        r"pass an int >= 1"),
    # predict
    Bad("predict-batch-negative", lambda t: t.parallel.predict(t.x, batch_size=-8), ValueError,
        r"pass an int >= 1"),
    Bad("predict-empty", lambda t: t.parallel.predict(t.x[:0]), ValueError,
        r"pass at least one sample"),
    Bad("predict-none", lambda t: t.parallel.predict(None), ValueError, r"pass the input data"),
    Bad("predict-features", lambda t: t.parallel.predict(t.x[:, :3]), ValueError,
        r"pass an array of shape \(samples, 5\)"),
    Bad("predict-keyword", lambda t: t.parallel.predict(t.x, batchsize=8), TypeError,
        r"takes the arguments of keras.Model.predict"),
]

def _unbuilt_subclassed():
    keras = _keras()

    class Dense2(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.out = keras.layers.Dense(2)

        def call(self, x):
            return self.out(x)

        def get_config(self):
            return {}

    return Dense2()


def _subclassed_stateful():
    keras = _keras()

    class Recurrent(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lstm, self.out = keras.layers.LSTM(3, stateful=True), keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.lstm(x))

    model = Recurrent()
    model(np.zeros((4, 2, 1), "float32"))
    return model


# stateful RNNs (t.stateful: an LSTM with a fixed batch of 8 on STATEFUL_GPUS devices) and
# rebatch
CATALOGUE += [
    Bad("parallelize-stateful-subclassed",
        lambda t: kmgpu.parallelize(_subclassed_stateful(), gpus=2), TypeError,
        r"build it as a Sequential or functional model"),
    Bad("parallelize-stateful-split", lambda t: kmgpu.parallelize(t.stateful_model, gpus=3),
        ValueError, r"fixed batch of 8, which does not split over 3 replicas.*gpus=2"),
    Bad("parallelize-reset-states", lambda t: kmgpu.parallelize(t.fresh(), reset_states="step"),
        ValueError, r"pass 'epoch'"),
    Bad("parallelize-drop-remainder",
        lambda t: kmgpu.parallelize(t.fresh(), drop_remainder="yes"), TypeError,
        r"drop_remainder must be True or False"),
    Bad("fit-stateful-batch", lambda t: t.stateful.fit(t.sx, t.sy, batch_size=16), ValueError,
        r"fixed batch of 8.*pass batch_size=8.*kmgpu.rebatch\(model, 16\)"),
    Bad("fit-stateful-whole-batches", lambda t: t.stateful.fit(t.sx[:12], t.sy[:12]),
        ValueError, r"12 samples, not a multiple of the stateful batch 8: pass the first 8"),
    Bad("fit-stateful-validation-split",
        lambda t: t.stateful.fit(t.sx, t.sy, validation_split=0.5), ValueError,
        r"Pass validation_data"),
    Bad("evaluate-stateful-batch", lambda t: t.stateful.evaluate(t.sx, t.sy, batch_size=4),
        ValueError, r"fixed batch of 8"),
    Bad("predict-stateful-whole-batches", lambda t: t.stateful.predict(t.sx[:5]), ValueError,
        r"5 samples, not a multiple of the stateful batch 8 and less than one batch: pad"),
    Bad("rebatch-zero", lambda t: kmgpu.rebatch(t.stateful_model, 0), ValueError,
        r"batch_size must be >= 1"),
    Bad("rebatch-float", lambda t: kmgpu.rebatch(t.stateful_model, 2.5), TypeError,
        r"batch_size must be an int >= 1"),
    Bad("rebatch-not-a-model", lambda t: kmgpu.rebatch(_keras().layers.LSTM(2), 1), TypeError,
        r"takes a keras.Model"),
    Bad("rebatch-wrapper", lambda t: kmgpu.rebatch(t.stateful, 1), TypeError,
        r"takes a keras.Model"),
]


def _launch(*argv):
    from kmgpu.commands import launch

    return launch.parse_args(list(argv))


# kmgpu launch (its arguments are checked before any process starts)
CATALOGUE += [
    Bad("launch-nnodes-zero", lambda t: _launch("--nnodes", "0", __file__), ValueError,
        r"pass the number of hosts, 1 or more"),
    Bad("launch-node-rank", lambda t: _launch("--nnodes", "2", "--node-rank", "2", __file__),
        ValueError, r"give each"),
    Bad("launch-nproc", lambda t: _launch("--nproc-per-node", "0", __file__), ValueError,
        r"pass 1 or more"),
    Bad("launch-port", lambda t: _launch("--master-port", "70000", __file__), ValueError,
        r"pass a free TCP port"),
    Bad("launch-no-script", lambda t: _launch("no_such_script.py"), ValueError,
        r"not found: pass the path"),
]


# -- the test -------------------------------------------------------------------------
#: the stateful cases are refused before any replica runs: 2 devices on TensorFlow, whose
#: fit that gives the optimizer state traces twice as long on 4; torch and JAX keep 4
STATEFUL_GPUS = 2 if _keras().backend.backend() == "tensorflow" else 4


class Target:
    """What the cases act on; one per module (the engine and its workers are reused)."""

    def __init__(self):
        self.x, self.y = data("mlp", 40)
        self.model = mlp()
        self.model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.parallel = kmgpu.parallelize(self.model, gpus=4)
            self.parallel.fit(self.x, self.y, batch_size=8, epochs=1, verbose=0)

        keras = _keras()
        keras.utils.set_random_seed(4)
        self.stateful_model = keras.Sequential([
            keras.Input(batch_shape=(8, 3, 2)), keras.layers.LSTM(4, stateful=True),
            keras.layers.Dense(1)])
        self.stateful_model.compile(optimizer="adam", loss="mse")
        self.sx = np.random.default_rng(1).normal(size=(16, 3, 2)).astype("float32")
        self.sy = self.sx.sum(axis=(1, 2))[:, None]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.stateful = kmgpu.parallelize(self.stateful_model, gpus=STATEFUL_GPUS)
            self.stateful.fit(self.sx, self.sy, epochs=1, verbose=0)

    @staticmethod
    def fresh():
        return mlp(seed=2)

    @staticmethod
    def nan(a):
        a = np.array(a, dtype="float32", copy=True)
        a.reshape(len(a), -1)[7, 0] = np.nan
        return a


@pytest.fixture(scope="module")
def target():
    return Target()


def model_state(model):
    """Everything a refused call must leave alone, as comparable values."""
    opt = model.optimizer
    return {
        "weights": [w.copy() for w in model.get_weights()],
        "config": json.dumps(model.get_config(), sort_keys=True, default=repr),
        "compiled": model.compiled,
        "compile": json.dumps(model.get_compile_config(), sort_keys=True, default=repr),
        "optimizer": id(opt),
        "optimizer_state": [np.array(v.numpy()) for v in opt.variables] if opt.built else None,
        "states": [np.array(_keras().ops.convert_to_numpy(v.value))
                   for v in replication.state_variables(model)],
    }


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key in ("weights", "optimizer_state", "states"):
            assert len(a[key]) == len(b[key]), key
            for u, v in zip(a[key], b[key]):
                assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("case", CATALOGUE, ids=repr)
def test_bad_input_is_refused_and_changes_nothing(case, target):
    models = (target.model, target.stateful_model)
    before, procs = [model_state(m) for m in models], children()
    assert int(target.model.optimizer.iterations.numpy()) == 5  # Adam has state to keep
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(case.error, match=case.match):
            case.call(target)
    for model, state in zip(models, before):
        assert_same_state(state, model_state(model))
    assert children() == procs  # no worker started, stopped or restarted


def test_the_catalogue_covers_every_entry_point():
    ids = [case.id for case in CATALOGUE]
    assert len(ids) == len(set(ids)) and len(ids) >= 25
    for where in ("simulate", "parallelize", "compile", "fit", "evaluate", "predict", "rebatch",
                  "launch"):
        assert sum(i.startswith(where + "-") for i in ids) >= 3, where


def test_after_the_catalogue_the_model_still_trains(target):
    """Nothing the refused calls did is left behind: the next calls run normally."""
    target.parallel.fit(target.x, target.y, batch_size=8, epochs=1, verbose=0)
    assert int(target.model.optimizer.iterations.numpy()) == 10
    pred = target.parallel.predict(target.x, batch_size=8, verbose=0)
    np.testing.assert_allclose(pred, target.model.predict(target.x, verbose=0), rtol=1e-5,
                               atol=1e-6)
    # a NaN in x that trains nothing (validation_data's, evaluate's) is not refused: it shows
    # in the metrics as in plain Keras (NaN, or not even that where the backend's relu maps
    # NaN to 0: TensorFlow on a CPU); only fit's training data is scanned
    bad = target.nan(target.x)
    history = target.parallel.fit(target.x, target.y, batch_size=8, epochs=1, verbose=0,
                                  validation_data=(bad, target.y))
    plain = np.ravel(target.model.evaluate(bad, target.y, batch_size=8, verbose=0))[0]
    got = np.ravel(target.parallel.evaluate(bad, target.y, batch_size=8, verbose=0))[0]
    assert np.isfinite(history.history["loss"][0])
    np.testing.assert_allclose([history.history["val_loss"][0], got], [plain, plain],
                               rtol=1e-5, equal_nan=True)


# -- property test ----------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PARALLEL = {}  # (devices, policy) -> (model, parallel): engines reused between examples
_INITIAL = {}


def _wrapped(devices, policy):
    key = (devices, policy)
    if key not in _PARALLEL:
        model = mlp(seed=3)
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        _INITIAL[key] = [w.copy() for w in model.get_weights()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _PARALLEL[key] = (model, kmgpu.parallelize(model, gpus=devices, batch=policy))
    model, parallel = _PARALLEL[key]
    model.set_weights(_INITIAL[key])
    return model, parallel


def _one_device(weights, x):
    w1, b1, w2, b2 = weights
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(samples=st.integers(1, 45), batch=st.integers(1, 16), devices=st.integers(1, 4),
       policy=st.sampled_from(["global", "per_replica"]))
def test_any_size_device_count_and_policy(samples, batch, devices, policy):
    """predict: every row once, in order, equal to one device; evaluate: equal to one
    device; fit: runs, with ceil(samples / global batch) steps and finite weights."""
    x, y = data("mlp", samples, seed=samples)
    model, parallel = _wrapped(devices, policy)
    global_batch = batch * devices if policy == "per_replica" else batch
    want_pred = _one_device(model.get_weights(), x)  # the MLP in NumPy: no compile per shape
    err = want_pred.astype("float64") - y
    want_eval = {"loss": float(np.mean(err ** 2)), "mae": float(np.mean(np.abs(err)))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pred = parallel.predict(x, batch_size=batch, verbose=0)
        got_eval = parallel.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        steps = int(model.optimizer.iterations.numpy())
        history = parallel.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert pred.shape == (samples, 1)
    np.testing.assert_allclose(pred, want_pred, rtol=1e-5, atol=1e-6)
    assert got_eval.keys() == want_eval.keys()
    for key, value in want_eval.items():
        assert got_eval[key] == pytest.approx(value, rel=2e-5, abs=1e-6), key
    assert int(model.optimizer.iterations.numpy()) - steps == -(-samples // global_batch)
    assert np.isfinite(history.history["loss"][0])
    assert all(np.isfinite(w).all() for w in model.get_weights())

"""Small models and data shared by the tests, and the parity measure."""

import numpy as np

# for the JAX and torch processes the tests start (launch ranks, torchrun, a parent to
# kill): the bench's workers need the same, so one function serves both
from kmgpu.bench.common import without_other_backends  # noqa: F401


def batch_logs():
    """A Keras callback keeping the logs of every train and test batch end, in order (what a
    LossHistory or TensorBoard with update_freq="batch" records): ``.train``, ``.test``."""
    import keras

    class BatchLogs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.train, self.test = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.train.append(dict(logs))

        def on_test_batch_end(self, batch, logs=None):
            self.test.append(dict(logs))

    return BatchLogs()


def shard_values():
    """Every ``shard`` value the session's backend takes (TensorFlow: None only): the
    tests of what users pass to ``fit`` run under each, ``shard`` being a mode."""
    from kmgpu import hardware

    if hardware.backend_name() == "tensorflow":
        return [None]
    return [None, "optimizer", "gradients", "weights"]


def rel_diff(a_weights, b_weights):
    """Largest relative difference between two weight lists: per tensor max|a-b| / max|a|.

    The denominator is floored at 1e-3 so that tensors which stay at float noise
    (a conv bias under BatchNorm gets no real gradient: |a| ~ 1e-10) do not turn
    rounding into a 100% "difference".
    """
    assert len(a_weights) == len(b_weights)
    worst = 0.0
    for a, b in zip(a_weights, b_weights):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert a.shape == b.shape
        worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-3)))
    return worst


def assert_trained_alike(ref, model, tol=1e-5, key_bias_tol=1e-3):
    """``model``'s weights within ``tol`` of ``ref``'s (``rel_diff``), its attention key
    biases within ``key_bias_tol``. A key bias shifts every key's score alike, which softmax
    ignores: its gradient is zero in exact arithmetic, so Adam turns the rounding noise of
    another summation order into steps (up to ~1e-5 relative in the keras-hub tests). It
    changes no output, and it still has to stay close."""
    key_bias = [v.path.endswith("key/bias") for v in model.weights]
    ours, theirs = model.get_weights(), ref.get_weights()
    assert rel_diff([a for a, k in zip(theirs, key_bias) if not k],
                    [b for b, k in zip(ours, key_bias) if not k]) <= tol
    assert rel_diff([a for a, k in zip(theirs, key_bias) if k],
                    [b for b, k in zip(ours, key_bias) if k]) <= key_bias_tol


def optimizer_state(model):
    """The model's optimizer variables as float64 arrays, in the optimizer's order."""
    return [np.asarray(v.value, dtype="float64") for v in model.optimizer.variables]


def tiny_mlp(metrics=None, **compile_args):
    """A compiled Dense(3 -> 2): the smallest model a test of Keras's own behaviour fits."""
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=metrics, **compile_args)
    return model


def tiny_xy(rows=8):
    """``rows`` inputs for ``tiny_mlp`` and their targets (ones)."""
    x = np.linspace(-1, 1, rows * 3, dtype="float32").reshape(rows, 3)
    return x, np.ones((rows, 2), "float32")


def two_output_model():
    """Dense(3 -> 1) twice, outputs "a" (mse) and "b" (mae): one loss tracker per output."""
    import keras

    inputs = keras.Input((3,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs),
                                 "b": keras.layers.Dense(1, name="b")(inputs)})
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"})
    return model


def keras_reference(model):
    """``model`` for a test's plain-Keras, one-device side, with the fix kmgpu's JAX
    replicas get (``step_fixes.fresh_loss_ids``): Keras's own JAX steps may drop one
    layer's ``add_loss`` term from a batch of a new shape (a last, partial one), by where
    objects happen to land in memory, so a reference without it fails a parity test now
    and then."""
    import keras

    if keras.backend.backend() == "jax":
        from kmgpu.engines.jax import step_fixes

        step_fixes.fresh_loss_ids(model)
    return model


def one_device_input(data):
    """``data`` for a test's plain-Keras, one-device side: a ``tf.data`` dataset without
    tf.data's autotuning (the same elements; anything else as it is). Plain Keras keeps
    its iterator in the model's reference cycles, so the garbage collector destroys it
    later, in whichever test is running then, and TensorFlow waits there for the
    iterator's tuning thread to wake from its sleep, which doubles up to 60 s: such a
    collection stalled later tests by tens of seconds. kmgpu's own iterators are untuned
    (``engines/tensorflow/data_fixes.untuned_iterators``)."""
    import sys

    tf = sys.modules.get("tensorflow")  # a dataset means it is imported; no import else
    if tf is None or not isinstance(data, tf.data.Dataset):
        return data
    options = tf.data.Options()
    options.autotune.enabled = False
    return data.with_options(options)


def few_steps():
    """``pytest.warns`` for the warning kmgpu gives on purpose when a fit has fewer than 10
    steps per epoch (the first fit of a ParallelModel; tests train tiny data)."""
    import pytest

    return pytest.warns(UserWarning, match=r"kmgpu: only \d+ step\(s\) per epoch")


def one_device():
    """``pytest.warns`` for kmgpu's warning that one device runs as a single replica."""
    import pytest

    return pytest.warns(UserWarning, match=r"kmgpu: one device \(.*\) - running as a single")


def mlp(seed=1, features=5):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])


def conv_bn(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)  # BN cancels a bias: its gradient is float noise that Adam amplifies
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(3)(h)
    return keras.Model(inputs, outputs)


def lstm(seed=1):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6, 3)), keras.layers.LSTM(8), keras.layers.Dense(1)])


def data(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        x = rng.normal(size=(n, 5))
        y = x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(n, 1))
    elif kind == "conv_bn":
        x = rng.normal(size=(n, 8, 8, 3))
        y = rng.normal(size=(n, 3))
    elif kind == "lstm":
        x = rng.normal(size=(n, 6, 3))
        y = x.sum(axis=(1, 2))[:, None] / 6
    else:
        raise ValueError(kind)
    return x.astype("float32"), y.astype("float32")


MODELS = {"mlp": mlp, "conv_bn": conv_bn, "lstm": lstm}



def row_batches(x, y, size=12):
    """A ``keras.utils.PyDataset`` of ``x``, ``y`` in batches of ``size`` rows (the last
    one partial), in order."""
    import keras

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-len(x) // size)

        def __getitem__(self, i):
            return x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]

    return Batches()


def check_pydataset_parity(tol=1e-5):
    """A PyDataset of 45 rows in batches of 12 (last 9) on 4 devices: the weights equal
    one device's after 2 epochs and predict gives every row, equal to plain predict."""
    import kmgpu

    x, y = data("mlp", 45)
    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(row_batches(x, y), epochs=2, shuffle=False, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(row_batches(x, y), epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= tol
    pred = parallel.predict(row_batches(x, y), verbose=0)
    assert pred.shape == (45, 1)
    np.testing.assert_allclose(pred, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


# -- processes (Linux /proc) ------------------------------------------------------------
def alive(pid):
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid=None):
    """Live child processes of ``pid`` (default: this process), sorted."""
    import os

    pid, out = os.getpid() if pid is None else pid, []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(name))
    return sorted(out)


def command_lines(pids):
    """{pid: command line} of live processes, for assertion messages."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            out[pid] = "?"
    return out


def listed_batches(batches):
    """A ``keras.utils.PyDataset`` that serves ``batches`` (a list of (x, y[, w])) in order."""
    import keras

    class Listed(keras.utils.PyDataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    return Listed()

"""``kmgpu.ShardedCheckpoint`` within one process, under every ``shard`` value the backend
takes (resuming in a new process, on 4 and 2 devices: test_resume.py): what each epoch
end saves equals one device's state after that epoch (weights, optimizer state, the
learning rate); ``kmgpu.checkpoints.load`` puts it into a plain Keras model, which
exports it to ``.keras`` and ``.weights.h5``, and ``checkpoints.export`` writes those
weights files from the checkpoint itself; ``save_best_only``, ``keep`` and the errors a
wrong call gets."""

import json
import os

import keras
import numpy as np
import pytest

import kmgpu
from kmgpu import checkpoints
from kmgpu.engines import checkpoint_files
from tests.helpers import data, few_steps, mlp, rel_diff, shard_values

TOL = 1e-5
ROWS, BATCH, EPOCHS = 40, 8, 2  # 5 steps an epoch


def _compiled(seed=1):
    model = mlp(seed)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _state(model):
    variables, _ = checkpoint_files.state_variables(model)
    return [np.array(v.numpy()) for v in variables]


@pytest.fixture(scope="module")
def one_device():
    """The state of a one-device fit after each epoch."""
    x, y = data("mlp", ROWS)
    model = _compiled()
    states = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            states.append(_state(self.model))

    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[Record()])
    return states, history.history["loss"]


@pytest.fixture(scope="module", params=shard_values(), ids=str)
def saved(request, tmp_path_factory):
    """A kmgpu fit on the 4 simulated devices with ``ShardedCheckpoint(keep=2)``."""
    shard = request.param
    directory = tmp_path_factory.mktemp(f"ckpt-{shard}")
    x, y = data("mlp", ROWS)
    model = _compiled()
    parallel = kmgpu.parallelize(model, shard=shard)
    with few_steps():
        history = parallel.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                               verbose=0,
                               callbacks=[kmgpu.ShardedCheckpoint(directory, keep=2)])
    return directory, model, parallel, history


def test_each_epoch_end_saves_one_devices_state_then(saved, one_device):
    directory, _, _, history = saved
    states, losses = one_device
    assert sorted(os.listdir(directory)) == ["epoch-00000", "epoch-00001", "latest"]
    np.testing.assert_allclose(history.history["loss"], losses, rtol=TOL)
    for epoch in range(EPOCHS):
        folder = os.path.join(directory, f"epoch-{epoch:05d}")
        with open(os.path.join(folder, checkpoint_files.MANIFEST)) as f:
            manifest = json.load(f)
        assert manifest["epoch"] == epoch
        arrays = checkpoint_files.open_arrays(folder, manifest).read(copy=True)
        assert len(arrays) == len(states[epoch]) == 4 + 1 + 2 * 4 + 1  # weights, step, Adam, lr
        assert rel_diff(states[epoch], arrays) <= TOL, epoch


def test_a_checkpoint_loads_into_plain_keras_and_exports(saved, tmp_path, one_device):
    directory, model, _, _ = saved
    plain = _compiled(seed=9)  # other initial values: only the checkpoint makes them equal
    assert checkpoints.load(directory, plain) == EPOCHS - 1
    assert rel_diff(one_device[0][-1], _state(plain)) <= TOL
    assert rel_diff(model.get_weights(), plain.get_weights()) <= TOL
    x, _ = data("mlp", 8)
    plain.save(tmp_path / "exported.keras")
    again = keras.models.load_model(tmp_path / "exported.keras")
    assert rel_diff(_state(plain), _state(again)) == 0.0
    weights_only = mlp(seed=5)
    plain.save_weights(tmp_path / "exported.weights.h5")
    weights_only.load_weights(tmp_path / "exported.weights.h5")
    np.testing.assert_allclose(weights_only.predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=TOL, atol=1e-6)
    bare = mlp(seed=6)  # no optimizer: the weights only
    checkpoints.load(directory, bare)
    assert rel_diff(model.get_weights(), bare.get_weights()) <= TOL


def test_a_checkpoint_exports_streamed_to_keras_weights_files(saved, tmp_path, one_device):
    """``checkpoints.export`` writes Keras's own ``.weights.h5`` and sharded weights files
    from the checkpoint's arrays: a model that loads either holds one device's state, and
    the model that gave the layout keeps its own values (its variables are not read)."""
    directory, _, _, _ = saved
    layout = _compiled(seed=9)
    layout.optimizer.build(layout.trainable_variables)
    before = _state(layout)
    assert checkpoints.export(directory, layout, tmp_path / "c.weights.h5") == EPOCHS - 1
    checkpoints.export(directory, layout, tmp_path / "c.weights.json", max_shard_size=1e-6)
    assert rel_diff(before, _state(layout)) == 0.0
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".h5")]) > 2  # shards
    for name in ("c.weights.h5", "c.weights.json"):
        again = _compiled(seed=5)
        again.optimizer.build(again.trainable_variables)
        again.load_weights(tmp_path / name)
        assert rel_diff(one_device[0][-1], _state(again)) <= TOL, name
    bare = mlp(seed=6)  # no optimizer: the weights only
    checkpoints.export(directory, bare, tmp_path / "w.weights.h5")
    loaded = mlp(seed=7)
    loaded.load_weights(tmp_path / "w.weights.h5")
    assert rel_diff(one_device[0][-1][:4], loaded.get_weights()) <= TOL


def test_a_finished_checkpoint_resumes_after_its_last_epoch(saved, one_device):
    """The same callback in a next fit of as many epochs: nothing left to train."""
    directory, _, _, _ = saved
    x, y = data("mlp", ROWS)
    model = _compiled(seed=3)
    with few_steps():
        history = kmgpu.parallelize(model, gpus=2).fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
            callbacks=[kmgpu.ShardedCheckpoint(directory, keep=2)])
    assert history.epoch == []
    assert rel_diff(one_device[0][-1][:4], model.get_weights()) <= TOL


def test_save_best_only_keeps_the_best_epoch(tmp_path):
    x, y = data("mlp", ROWS)
    model = _compiled()
    parallel = kmgpu.parallelize(model)
    # the loss falls: in "max" mode only the first epoch is the best
    with few_steps():
        history = parallel.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                               callbacks=[kmgpu.ShardedCheckpoint(
                                   tmp_path, monitor="loss", mode="max",
                                   save_best_only=True)])
    folder, manifest = checkpoint_files.latest(tmp_path)
    assert os.path.basename(folder) == "epoch-00000"
    assert manifest["best"] == pytest.approx(history.history["loss"][0], rel=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["epoch-00000", "latest"]


def test_wrong_calls_say_what_to_do(saved):
    directory, _, _, _ = saved
    with pytest.raises(ValueError, match="mode 'up'"):
        kmgpu.ShardedCheckpoint(directory, mode="up")
    with pytest.raises(ValueError, match="keep at least 1"):
        kmgpu.ShardedCheckpoint(directory, keep=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoints.load(os.path.join(directory, "missing"), mlp())
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    before = other.get_weights()
    with pytest.raises(ValueError, match="Restore it into the model it was saved from"):
        checkpoints.load(directory, other)
    assert rel_diff(before, other.get_weights()) == 0.0


def test_resuming_another_models_checkpoint_is_refused(saved):
    directory, _, _, _ = saved
    x, _ = data("mlp", ROWS)
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    other.compile(optimizer="adam", loss="mse")
    before = other.get_weights()
    parallel = kmgpu.parallelize(other)
    with few_steps(), pytest.raises(ValueError,
                                     match="Restore it into the model it was saved from"):
        parallel.fit(x, x[:, :1], batch_size=BATCH, epochs=1, verbose=0,
                     callbacks=[kmgpu.ShardedCheckpoint(directory)])
    assert rel_diff(before, other.get_weights()) == 0.0
    parallel.fit(x, x[:, :1], batch_size=BATCH, epochs=1, verbose=0)  # still usable


def test_a_stateful_models_checkpoint_holds_its_state_not_its_rows(tmp_path):
    """The stateful RNN rows an engine may track beside the weights stay out (as they stay
    out of Keras's own weights files): the checkpoint loads into the plain model."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3, 2), batch_size=8),
                              keras.layers.LSTM(4, stateful=True), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 3, 2)).astype("float32")
    with few_steps():
        kmgpu.parallelize(model, gpus=2).fit(
            x, x.sum(axis=(1, 2))[:, None], batch_size=8, epochs=1, shuffle=False,
            verbose=0, callbacks=[kmgpu.ShardedCheckpoint(tmp_path)])
    plain = keras.Sequential([keras.Input((3, 2), batch_size=8),
                              keras.layers.LSTM(4, stateful=True), keras.layers.Dense(1)])
    plain.compile(optimizer="adam", loss="mse")
    assert checkpoints.load(tmp_path, plain) == 0
    assert rel_diff(model.get_weights(), plain.get_weights()) <= TOL


def test_a_shuffled_fit_resumes_in_the_orders_it_would_have_drawn(tmp_path):
    """A checkpoint keeps the host random states Keras's shuffles draw from: a shuffled fit
    stopped after 2 epochs and resumed (its random states reset, as in a new process)
    ends as 3 uninterrupted epochs on one device. TensorFlow's tf.data shuffles draw from
    the graph's own generators, which a checkpoint does not hold: there the resumed fit
    runs its last epoch alone, in an order drawn anew."""
    x, y = data("mlp", ROWS)
    fit = dict(batch_size=BATCH, shuffle=True, verbose=0)
    keras.utils.set_random_seed(0)
    reference = _compiled()
    expected = reference.fit(x, y, epochs=3, **fit).history["loss"]
    keras.utils.set_random_seed(0)
    with few_steps():
        kmgpu.parallelize(_compiled(), gpus=2).fit(
            x, y, epochs=2, callbacks=[kmgpu.ShardedCheckpoint(tmp_path)], **fit)
    keras.utils.set_random_seed(0)
    model = _compiled()
    with few_steps():
        history = kmgpu.parallelize(model).fit(
            x, y, epochs=3, callbacks=[kmgpu.ShardedCheckpoint(tmp_path)], **fit)
    assert history.epoch == [2]
    if keras.backend.backend() == "tensorflow":
        assert np.isfinite(history.history["loss"][0])
        return
    np.testing.assert_allclose(history.history["loss"], expected[2:], rtol=TOL)
    assert rel_diff(reference.get_weights(), model.get_weights()) <= TOL

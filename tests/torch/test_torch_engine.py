"""What only the torch engine has: worker processes, faults, Jupyter (torchrun: test_launch).

Parity (MLP, Conv+BN, LSTM x SGD/Adam x 2/4 devices, 97 samples / batch 20 / 3
devices) and the sine scenario run from tests/common on every backend.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import kmgpu
from tests.helpers import (MODELS, alive, check_pydataset_parity, children, command_lines,
                           conv_bn, data, few_steps, mlp, rel_diff)

TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reference(kind, x, y, batch_size, epochs=2, optimizer="adam", metrics=None, **fit):
    ref = MODELS[kind]()
    ref.compile(optimizer=optimizer, loss="mse", metrics=metrics)
    ref.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit)
    return ref


def _call_dirs():
    import tempfile

    prefix = f"kmgpu-{os.getpid()}-"
    return [d for root in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(root)
            for d in os.listdir(root) if d.startswith(prefix)]


def _close_pools():
    from kmgpu.engines.torch.launch import launchers

    launchers.close_pools()


# -- parity the common tests do not cover ------------------------------------------
def test_lstm_sizes_that_do_not_divide():
    """97 samples, batch 20, 3 devices: 7/7/6-row slices and a last batch of 17."""
    x, y = data("lstm", 97)
    ref = _reference("lstm", x, y, 20, metrics=["mae"])
    model = MODELS["lstm"]()
    parallel = kmgpu.parallelize(model, gpus=3)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    with few_steps():
        parallel.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    pred = parallel.predict(x, batch_size=20, verbose=0)
    assert pred.shape == (97, 1)
    np.testing.assert_allclose(pred, ref.predict(x, batch_size=20, verbose=0), rtol=1e-5,
                               atol=1e-6)
    got = parallel.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    want = ref.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


@pytest.mark.parametrize("sync", [True, False])
def test_batchnorm_statistics_identical_on_every_rank(sync):
    x, y = data("conv_bn", 97)
    model = conv_bn()
    before = model.get_weights()
    parallel = kmgpu.parallelize(model, gpus=3, sync_batchnorm=sync)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    ranks = parallel._engine.rank_weights()
    assert len(ranks) == 3
    for other in ranks[1:]:
        for a, b in zip(ranks[0], other):
            np.testing.assert_array_equal(a, b)  # bit for bit, moving statistics included
    for a, b in zip(ranks[0], model.get_weights()):
        np.testing.assert_array_equal(a, b)
    bn = [i for i, w in enumerate(model.weights) if "moving" in w.path]
    assert bn and all(not np.array_equal(before[i], ranks[0][i]) for i in bn)
    if sync:
        ref = _reference("conv_bn", x, y, 20)
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert "global batch" in parallel.describe() if sync else "averaged" in parallel.describe()


def test_pydataset_input():
    check_pydataset_parity()


def _custom_step_class():
    import keras

    @keras.saving.register_keras_serializable(package="kmgpu_tests")
    class CustomStep(keras.Sequential):
        """A model with its own train_step (Keras's torch step, written out)."""

        def train_step(self, data):
            import torch

            x, y = data
            y_pred = self(x, training=True)
            self.zero_grad()
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
            self._loss_tracker.update_state(loss, sample_weight=x.shape[0])
            return self.compute_metrics(x, y, y_pred)

    return CustomStep


def test_a_model_with_its_own_train_step_still_syncs_gradients():
    import keras

    cls = _custom_step_class()
    x, y = data("mlp", 64)

    def build():
        keras.utils.set_random_seed(1)
        return cls([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(1)])

    ref = build()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = build()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # even split
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL


# -- callbacks: once, in this process, with the user's model --------------------------
def test_callbacks_run_once_here_and_steer_every_rank(tmp_path):
    import keras

    x, y = data("mlp", 60)

    def schedule(epoch, lr):
        return 0.05 / (epoch + 1)

    ref = mlp()
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.append((os.getpid(), e, logs["loss"],
                                                  model.get_weights()[0].copy())))
    path = str(tmp_path / "best.keras")
    with few_steps():
        hist = parallel.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.LearningRateScheduler(schedule), probe,
            keras.callbacks.ModelCheckpoint(path)])
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 / 3)
    assert [s[:2] for s in seen] == [(os.getpid(), 0), (os.getpid(), 1), (os.getpid(), 2)]
    assert [s[2] for s in seen] == pytest.approx(hist.history["loss"])
    assert not np.array_equal(seen[0][3], seen[2][3])  # the model held each epoch's weights
    np.testing.assert_array_equal(seen[2][3], model.get_weights()[0])
    np.testing.assert_allclose(keras.saving.load_model(path).get_weights()[0],
                               model.get_weights()[0])

    # EarlyStopping in this process stops every rank at the same step
    def stop():
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)

    want = ref.fit(x, y, batch_size=16, epochs=20, verbose=0, callbacks=[stop()])
    hist = parallel.fit(x, y, batch_size=16, epochs=20, shuffle=False, verbose=0,
                        callbacks=[stop()])
    assert len(hist.history["loss"]) == len(want.history["loss"]) == 2
    assert parallel.evaluate(x, y, verbose=0) == pytest.approx(
        float(np.mean((model.predict(x, verbose=0) - y) ** 2)), rel=1e-5)


def test_progress_bar_reaches_this_process(capsys):
    x, y = data("mlp", 48)
    parallel = kmgpu.parallelize(mlp(), gpus=2)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "3/3" in out and "loss" in out
    parallel.evaluate(x, y, verbose=1)
    assert "2/2" in capsys.readouterr().out  # 48 rows, Keras's default batch of 32


# -- faults and clean ends ------------------------------------------------------------
def _boom_loss(y_true, y_pred):
    import keras
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_worker_exception_comes_back_with_its_traceback():
    from kmgpu.engines.torch.launch.pool import WorkerError

    x, y = data("mlp", 32)
    model = mlp()
    before = model.get_weights()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="sgd", loss=_boom_loss)
    with pytest.raises(ValueError, match="boom on rank 1") as info, few_steps():
        parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)
    cause = info.value.__cause__
    assert isinstance(cause, WorkerError)
    assert "rank 1" in str(cause) and "_boom_loss" in str(cause)  # the worker's traceback
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    parallel.compile(optimizer="sgd", loss="mse")
    parallel.fit(x, y, batch_size=8, epochs=1, verbose=0)  # a fresh pool
    assert rel_diff(before, model.get_weights()) > 1e-4


def _long_fit(gpus=2):
    x, y = data("mlp", 640)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=gpus)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)  # workers up
    return model, parallel, x, y


def test_a_killed_worker_ends_fit_within_30s_and_the_next_fit_works():
    model, parallel, x, y = _long_fit()
    pids = parallel._engine.worker_pids()
    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        parallel.fit(x, y, batch_size=32, epochs=1000, shuffle=False, verbose=0)
    assert time.monotonic() - start < 31.0
    assert not any(alive(pid) for pid in pids)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    parallel.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert set(parallel._engine.worker_pids()).isdisjoint(pids)


def test_ctrl_c_stops_every_worker_after_a_step_and_keeps_it_and_the_pool():
    """Ctrl-C at any moment: the workers stop together after a step, that step's state comes
    back, and the pool serves the next call. tests/torch/test_interrupts.py checks the
    weights against one device."""
    model, parallel, x, y = _long_fit()
    before = model.get_weights()
    steps_before = int(model.optimizer.iterations.numpy())
    pids = parallel._engine.worker_pids()
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        parallel.fit(x, y, batch_size=32, epochs=1000, shuffle=False, verbose=0)
    assert parallel._engine.worker_pids() == pids and all(alive(pid) for pid in pids)
    after = model.get_weights()
    assert rel_diff(before, after) > 1e-4
    assert all(np.isfinite(w).all() for w in after)
    assert int(model.optimizer.iterations.numpy()) > steps_before
    parallel.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert parallel._engine.worker_pids() == pids


def test_repeated_calls_reuse_the_pool_and_leak_nothing():
    _close_pools()
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    assert children() == [], command_lines(children())
    x, y = data("mlp", 50)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=10, epochs=1, verbose=0)
    pids = parallel._engine.worker_pids()
    assert sorted(pids) == children()
    open_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        parallel.fit(x, y, batch_size=10, epochs=1, verbose=0)
        parallel.evaluate(x, y, verbose=0)
        parallel.predict(x, verbose=0)
    assert parallel._engine.worker_pids() == pids and children() == sorted(pids)
    assert len(os.listdir("/proc/self/fd")) == open_fds
    assert len(_call_dirs()) == 1  # the pool's state file; each call's data is gone
    parallel.close()
    assert _call_dirs() == []
    assert children() == [] and not any(alive(pid) for pid in pids)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads


def test_spawned_workers(monkeypatch):
    """The start method when CUDA is initialised here: spawn (workers import Keras)."""
    _close_pools()
    monkeypatch.setenv("KMGPU_TORCH_START", "spawn")
    x, y = data("mlp", 40)
    ref = _reference("mlp", x, y, 8)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert parallel._engine.launcher.pool.method == "spawn"
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    parallel.close()


# -- other process models (torchrun in-process: tests/torch/test_launch.py) ----------
def test_progress_bar_shows_in_a_jupyter_cell(tmp_path):
    import nbclient
    import nbformat
    setup = (f"import os, sys\nos.environ['KERAS_BACKEND'] = 'torch'\n"
             f"sys.path.insert(0, {ROOT!r})\nimport kmgpu\nkmgpu.simulate_devices(2)\n"
             # the kernel seeds no TensorFlow (5-6 s of CPU to import it only for that)
             "from tests.helpers import data, mlp, without_other_backends\n"
             "without_other_backends()\nx, y = data('mlp', 48)\n"
             "parallel = kmgpu.parallelize(mlp(), gpus=2)\n"
             "parallel.compile(optimizer='sgd', loss='mse')\n"
             "parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)\n")
    fit = "parallel.fit(x, y, batch_size=16, epochs=2, verbose=1)\nparallel.close()\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup),
                                         nbformat.v4.new_code_cell(fit)])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.output_type == "stream")
    # the pool was started by the first cell; the second cell still shows its epochs
    assert "Epoch 1/2" in text and "Epoch 2/2" in text and "loss" in text, text

"""A fit that stops early keeps the last completed step, as plain Keras does:
a failing callback or Ctrl-C in the first epoch, with the pool and in-process.
"""

import os
import signal

import pytest

import kmgpu
from tests.helpers import alive, children, data, few_steps, mlp, one_device, rel_diff

TOL = 1e-5


class Fails(Exception):
    pass


def _failing_at(batch):
    import keras

    def fail(b, logs=None):
        if b == batch:
            raise Fails(f"at batch {b}")

    return keras.callbacks.LambdaCallback(on_train_batch_end=fail)


def _reference_steps(x, y, steps, batch):
    """One device after exactly ``steps`` steps of the first epoch."""
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x[:steps * batch], y[:steps * batch], batch_size=batch, epochs=1, shuffle=False,
            verbose=0)
    return ref


@pytest.mark.parametrize("shard", [None, "weights"], ids=str)
def test_a_failing_callback_in_the_first_epoch_keeps_that_step_and_the_pool(shard):
    x, y = data("mlp", 400)  # 50 steps per epoch
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    with pytest.raises(Fails):
        ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                callbacks=[_failing_at(5)])
    assert int(ref.optimizer.iterations.numpy()) == 6  # plain Keras: 6 steps kept
    model = mlp()
    # shard="weights": every rank writes its own pieces of the stopped state
    parallel = kmgpu.parallelize(model, gpus=2, shard=shard)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.evaluate(x, y, verbose=0)  # the pool is up
    pids = parallel._engine.worker_pids()
    with pytest.raises(Fails):
        parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                     callbacks=[_failing_at(5)])
    assert int(model.optimizer.iterations.numpy()) == 6
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    # the optimizer state came back too: one more epoch from here equals one device
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert parallel._engine.worker_pids() == pids and all(alive(p) for p in pids)


def test_ctrl_c_in_the_first_epoch_keeps_the_last_step_and_the_pool():
    import keras

    x, y = data("mlp", 4000)  # 500 steps per epoch
    warm = kmgpu.parallelize(mlp(), gpus=2)  # the pool is up (shared by both)
    warm.compile(optimizer="adam", loss="mse")
    with few_steps():
        warm.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer="adam", loss="mse")
    pids, running = warm._engine.worker_pids(), children()
    # Ctrl-C while the driver runs a callback at batch 7 (the workers wait for it)
    press = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs=None: b == 7 and os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        parallel.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[press])
    steps = int(model.optimizer.iterations.numpy())
    assert steps in (8, 9)  # batch 7 done (plain Keras: 8), or the one rank 0 had begun
    assert rel_diff(_reference_steps(x, y, steps, 8).get_weights(), model.get_weights()) <= TOL
    assert parallel._engine.worker_pids() == pids and all(alive(p) for p in pids)
    assert children() == running  # no process started or left behind
    parallel.fit(x[:80], y[:80], batch_size=8, epochs=1, verbose=0)  # the pool still works
    assert parallel._engine.worker_pids() == pids


def test_in_process_a_failing_callback_keeps_that_step(tmp_path):
    """One in-process rank (a process group of one, as torchrun would make): the
    replica's state at the failing step comes back to the user's model."""
    import torch.distributed as dist

    from kmgpu.engines.torch.launch import launchers

    x, y = data("mlp", 400)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    with pytest.raises(Fails):
        ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                callbacks=[_failing_at(5)])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        assert launchers.in_distributed_job()
        model = mlp()
        with one_device():
            parallel = kmgpu.parallelize(model)
        assert "in-process" in parallel._engine.name
        parallel.compile(optimizer="adam", loss="mse")
        with pytest.raises(Fails):
            parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         callbacks=[_failing_at(5)])
        assert int(model.optimizer.iterations.numpy()) == 6
        assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    finally:
        dist.destroy_process_group()

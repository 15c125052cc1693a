"""What a pool fit moves per epoch when kmgpu's own measuring callbacks run: nothing but
the relayed hooks.

``kmgpu bench`` times every run with ``EpochTimer`` and ``GPUMonitor``. They were not
known to be weight-free, so the driver loaded rank 0's whole state (weights + optimizer
state: ~280 MB for ResNet-50 with Adam) at every epoch end, and rank 0 snapshotted it
for that: ~0.5 s per epoch on 2 H200s, the captured step's 2-GPU gain lost in the bench.
"""

import os

import numpy as np
import pytest

import kmgpu
from kmgpu.callbacks import EpochTimer, GPUMonitor
from tests.helpers import conv_bn, data, few_steps, rel_diff

EPOCHS = 4


@pytest.fixture
def loads(monkeypatch):
    """Counts the driver's loads of rank 0's state (one per epoch end a callback needs
    the weights at, and one at the end of training)."""
    from kmgpu.engines.torch.launch import launchers

    count = {"n": 0}
    original = launchers.PoolLauncher.load_state

    def load_state(self, template):
        count["n"] += 1
        return original(self, template)

    monkeypatch.setattr(launchers.PoolLauncher, "load_state", load_state)
    return count


def _fit(callbacks, jit=True):
    import keras

    x, y = data("conv_bn", 80)
    model = conv_bn()
    parallel = kmgpu.parallelize(model, gpus=2)
    parallel.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit)
    with few_steps():
        parallel.fit(x, y, batch_size=20, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=callbacks)
    return model


def test_kmgpu_measuring_callbacks_are_weight_free():
    import keras

    from kmgpu.engines.torch.launch import relay

    class Quiet(EpochTimer):  # no hook of its own: still only the clock
        pass

    class Saves(EpochTimer):  # its own on_epoch_end may read the weights
        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)

    class Watches(GPUMonitor):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)

    model = conv_bn()

    def driver(cbs):
        return relay.CallbackDriver(cbs, model, "fit", load_state=lambda: None)

    d = driver([EpochTimer(10), GPUMonitor(verbose=0), Quiet()])
    assert not d.needs_weights and not d.may_set_weights
    assert driver([Saves()]).needs_weights
    assert driver([Watches(verbose=0)]).may_set_weights
    assert driver([EpochTimer(), keras.callbacks.ModelCheckpoint("/tmp/x.weights.h5",
                                                                   save_weights_only=True)]
                  ).needs_weights


def test_bench_callbacks_load_the_state_once_per_fit(loads):
    """The bench's call pattern (EpochTimer + GPUMonitor, captured step, 2 ranks): one
    load of rank 0's state per fit (its end), not one per epoch; the weights are the
    same as without the callbacks, and the timer still sees every epoch."""
    plain = _fit(None)
    loads["n"] = 0
    timer, monitor = EpochTimer(80), GPUMonitor(interval=0.2, verbose=0)
    timed = _fit([timer, monitor])
    assert loads["n"] == 1, f"{loads['n']} loads of rank 0's state in one fit of {EPOCHS} epochs"
    assert len(timer.epoch_seconds) == EPOCHS
    assert rel_diff(plain.get_weights(), timed.get_weights()) == 0.0


def test_a_callback_that_may_read_weights_still_sees_each_epochs(loads):
    """A subclass with its own on_epoch_end gets the current weights at every epoch end."""
    seen = []

    class Reads(EpochTimer):
        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            seen.append([np.array(w) for w in self.model.get_weights()])

    model = _fit([Reads()], jit=False)
    assert loads["n"] == EPOCHS + 1
    assert len(seen) == EPOCHS
    assert rel_diff(seen[-1], model.get_weights()) == 0.0
    assert rel_diff(seen[0], seen[-1]) > 0.0  # they moved: each epoch's own weights


def test_a_sharded_checkpoint_moves_no_state_to_the_driver(loads, tmp_path):
    """The ranks write a ShardedCheckpoint's saves: the driver loads rank 0's state once
    per fit (its end), as without it, and the checkpoint holds the trained weights."""
    from kmgpu import checkpoints
    from kmgpu.engines.torch.launch import relay

    callback = kmgpu.ShardedCheckpoint(tmp_path)
    d = relay.CallbackDriver([callback], conv_bn(), "fit", load_state=lambda: None)
    assert not (d.needs_weights or d.may_set_weights or d.reads_state)
    loads["n"] = 0
    model = _fit([callback])
    assert loads["n"] == 1
    assert sorted(os.listdir(tmp_path)) == [f"epoch-{EPOCHS - 1:05d}", "latest"]
    fresh = conv_bn(seed=4)
    assert checkpoints.load(tmp_path, fresh, optimizer=False) == EPOCHS - 1
    assert rel_diff(model.get_weights(), fresh.get_weights()) == 0.0

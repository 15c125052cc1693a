"""What users and Keras's own callbacks do to a model between calls, under every ``shard``
value the backend takes: each sequence equals plain Keras doing the same on one device
(weights and optimizer state within 1e-5, ``optimizer.iterations``, each History).

- ``EarlyStopping(restore_best_weights=True)`` that stops early, then ``fit`` again;
- ``set_weights`` and ``load_weights`` on the user's model between fits;
- ``compile`` again with another optimizer between fits;
- ``model.optimizer.variables`` read after a fit, and a plain ``fit`` of the user's model;
- ``BackupAndRestore`` interrupted by an exception, then ``fit`` again in the same process
  (killed and resumed in a new process: ``test_resume.py``).

One pair of models per ``shard`` value walks through all of them, so a failure names its
step. 4 simulated devices, the tests' MLP, 80 rows at global batch 8.
"""

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff, shard_values

TOL = 1e-5


def state(model):
    """{path: value} of the model's weights and its optimizer's variables."""
    import keras

    variables = list(model.weights) + list(model.optimizer.variables)
    return {v.path: keras.ops.convert_to_numpy(v.value) for v in variables}


class Pair:
    """The user's model under kmgpu beside a plain-Keras model on one device, made alike,
    each step done to both and then compared."""

    def __init__(self, shard):
        self.ref, self.model = mlp(), mlp()
        for m in (self.ref, self.model):
            m.compile(optimizer="adam", loss="mse")
        self.parallel = kmgpu.parallelize(self.model, shard=shard)
        self.x, self.y = data("mlp", 80)  # 10 steps per epoch: no few-steps warning
        # validation data the model fits worse after a few epochs: EarlyStopping stops
        self.vx, self.vy = self.x[:16], -3 * self.y[:16]

    def fit(self, step, callbacks=lambda: [], **kwargs):
        """``fit`` both models (each its own callbacks), then compare; the Histories."""
        kwargs = dict(batch_size=8, shuffle=False, verbose=0, **kwargs)
        refs = callbacks()
        h_ref = self.ref.fit(self.x, self.y, callbacks=refs, **kwargs)
        h = self.parallel.fit(self.x, self.y, callbacks=callbacks(), **kwargs)
        self.same(step, h_ref, h)
        return h_ref, h

    def same(self, step, h_ref=None, h=None):
        ref, mine = state(self.ref), state(self.model)
        assert len(ref) == len(mine), f"{step}: {list(ref)} against {list(mine)}"
        for (path, a), b in zip(ref.items(), mine.values()):
            diff = rel_diff([a], [b])
            assert diff <= TOL, f"{step}: {path} {diff:.2e} from one device"
        assert int(self.model.optimizer.iterations) == int(self.ref.optimizer.iterations), step
        if h_ref is not None:
            assert h.epoch == h_ref.epoch, step
            assert h.history.keys() == h_ref.history.keys(), step
            for key, values in h_ref.history.items():
                np.testing.assert_allclose(h.history[key], values, rtol=TOL, atol=1e-6,
                                           err_msg=f"{step}: History[{key!r}]")

    def both(self, change):
        for m in (self.ref, self.model):
            change(m)


@pytest.mark.parametrize("shard", shard_values(), ids=str)
def test_changes_between_fits_equal_plain_keras(shard, tmp_path):
    import keras

    pair = Pair(shard)
    # EarlyStopping restores the best weights at the end of fit: the model changed after
    # the last step, and the next fit starts from those weights
    h_ref, _ = pair.fit("early stopping", epochs=8, validation_data=(pair.vx, pair.vy),
                        callbacks=lambda: [keras.callbacks.EarlyStopping(
                            patience=1, restore_best_weights=True)])
    assert len(h_ref.epoch) < 8, "the test's EarlyStopping did not stop early"
    pair.fit("fit after early stopping", epochs=1)

    pair.both(lambda m: m.set_weights([w * 0.9 for w in m.get_weights()]))
    pair.fit("fit after set_weights", epochs=1)

    path = str(tmp_path / "ckpt.weights.h5")
    pair.ref.save_weights(path)
    pair.fit("fit to move off the checkpoint", epochs=1)
    pair.both(lambda m: m.load_weights(path))
    pair.fit("fit after load_weights", epochs=1)

    pair.both(lambda m: m.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.5),
                                  loss="mse"))
    pair.fit("fit after compile with another optimizer", epochs=1)

    # the optimizer's variables read after a fit, then a plain Keras fit of the user's model
    slots = [keras.ops.convert_to_numpy(v.value) for v in pair.model.optimizer.variables]
    assert rel_diff([keras.ops.convert_to_numpy(v.value)
                     for v in pair.ref.optimizer.variables], slots) <= TOL
    for m in (pair.ref, pair.model):
        m.fit(pair.x, pair.y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    pair.same("a plain Keras fit of the user's model")
    pair.fit("kmgpu fit after the plain one", epochs=1)

    # last: Keras keeps the epoch a resumed fit started at on the model
    # (``_initial_epoch``), so plain Keras's next fit of it starts there too
    class Interrupt(keras.callbacks.Callback):  # raises in epoch 2, after its 4th batch
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 3:
                raise RuntimeError("interrupted")

    def backed_up(m, name, *more):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / f"backup_{name}"))
        return m.fit(pair.x, pair.y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                     callbacks=[backup, *more])

    for name, m in (("ref", pair.ref), ("kmgpu", pair.parallel)):
        with pytest.raises(RuntimeError, match="interrupted"):
            backed_up(m, name, Interrupt())
    pair.same("interrupted BackupAndRestore fit")
    h_ref, h = backed_up(pair.ref, "ref"), backed_up(pair.parallel, "kmgpu")
    pair.same("BackupAndRestore fit called again", h_ref, h)
    assert h.epoch == [1, 2]  # resumed after epoch 1, the last one it saw end
    pair.parallel.close()

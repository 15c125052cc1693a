"""TensorFlow: what a loop of calls repeats at each call, counted, not timed. After a
first call, more ``fit(epochs=1)`` calls on the same arrays (shuffled under a global
seed, as Keras's default shuffles, and not) and more ``train_on_batch`` calls must make
no new replica, distributed dataset or ``MultiDeviceIterator`` (~0.5 s each on 4 CPU
devices), trace no step or copy function again, and copy the trained state back in one
traced function, not one eager assign per variable; each call still trains as plain
Keras does on one device. The counts are the same on any device count: the fit loops run
on 2 devices (half the tracing of 4), the train_on_batch loop on 4 (batches of 7 rows
split 2, 2, 2, 1).
"""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import data, mlp, rel_diff

ROWS, BATCH, CALLS = 24, 8, 3


class Counts:
    """Counts of what the calls inside ``with counts:`` make and trace."""

    def __init__(self, monkeypatch, parallel):
        from tensorflow.python.data.ops import multi_device_iterator_ops as ops

        self.parallel, self.iterators, self.assigns, self.traces = parallel, 0, 0, 0
        init, assign = ops.OwnedMultiDeviceIterator.__init__, keras.Variable.assign
        template = {id(v) for v in parallel.model.variables}

        def counted_init(it, *args, **kwargs):
            self.iterators += 1
            return init(it, *args, **kwargs)

        def counted_assign(variable, value):
            self.assigns += id(variable) in template
            return assign(variable, value)

        monkeypatch.setattr(ops.OwnedMultiDeviceIterator, "__init__", counted_init)
        monkeypatch.setattr(keras.Variable, "assign", counted_assign)

    def watch_steps(self):
        """Count the replica's step traces (its Python step runs only when traced)."""
        replica = self.parallel._engine.replica
        for name in ("train_step", "test_step"):
            step = getattr(replica, name)

            def traced(data, step=step):
                self.traces += 1
                return step(data)
            setattr(replica, name, traced)

    def state(self):
        engine = self.parallel._engine
        return (engine.replica, getattr(engine._kept.get("fit"), "builds", None),
                getattr(getattr(engine, "_pair_functions", None), "traces", None))


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "unshuffled"])
def test_repeated_fits_make_nothing_new(monkeypatch, shuffle):
    x, y = data("mlp", ROWS)
    reference = mlp(7)
    reference.compile(optimizer="adam", loss="mse")
    parallel = kmgpu.parallelize(mlp(7), gpus=2)
    parallel.compile(optimizer="adam", loss="mse")

    def both():
        for model in (reference, parallel):
            keras.utils.set_random_seed(5)  # one global seed: Keras shuffles alike each call
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=shuffle, verbose=0)
        assert rel_diff(reference.get_weights(), parallel.model.get_weights()) <= 1e-5

    with pytest.warns(UserWarning, match="step"):
        both()
    both()  # the template's optimizer exists from the first call's copy back on
    counts = Counts(monkeypatch, parallel)
    counts.watch_steps()
    before, iterator = counts.state(), list(parallel._engine._kept["fit"]._slot)
    for _ in range(CALLS):
        both()
    assert (counts.iterators, counts.traces, counts.assigns) == (0, 0, 0)
    assert counts.state() == before  # same replica, no new dataset, no new copy function
    assert iterator and parallel._engine._kept["fit"]._slot == iterator


def test_train_on_batch_loop_makes_nothing_new(monkeypatch):
    x, y = data("mlp", ROWS)
    reference = mlp(8)
    reference.compile(optimizer="adam", loss="mse", metrics=["mae"])
    parallel = kmgpu.parallelize(mlp(8), gpus=4)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    batches = [(x[i:i + 7], y[i:i + 7]) for i in range(0, 21, 7)]  # 7 rows: 2, 2, 2, 1

    def both(bx, by):
        plain = reference.train_on_batch(bx, by, return_dict=True)
        ours = parallel.train_on_batch(bx, by, return_dict=True)
        assert rel_diff(reference.get_weights(), parallel.model.get_weights()) <= 1e-5
        for key, value in plain.items():
            np.testing.assert_allclose(ours[key], value, rtol=1e-6)

    both(*batches[0])
    both(*batches[0])  # the template's optimizer exists from the first call's copy back on
    counts = Counts(monkeypatch, parallel)
    counts.watch_steps()
    before = counts.state()
    for bx, by in batches[1:] * 2:
        both(bx, by)
    assert counts.state() == before
    assert (counts.iterators, counts.traces, counts.assigns) == (0, 0, 0)


def test_unseeded_shuffled_fits_read_one_iterator(monkeypatch):
    """shuffle=True without a global seed: every pass draws a new permutation, in plain
    Keras's new pipeline per call as in the one kept pipeline, so kmgpu keeps it; each
    call still reads every row once per epoch (the loss of the whole pass equals
    evaluate's order-free loss before it, SGD at learning rate 0)."""
    import tensorflow as tf

    x, y = data("mlp", ROWS)
    parallel = kmgpu.parallelize(mlp(9), gpus=2)
    parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    tf.random.set_seed(None)  # no global seed: Keras's shuffle draws anew
    try:
        with pytest.warns(UserWarning, match="step"):
            parallel.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        expected = parallel.evaluate(x, y, batch_size=BATCH, verbose=0)
        counts = Counts(monkeypatch, parallel)
        iterator = list(parallel._engine._kept["fit"]._slot)
        for _ in range(CALLS):
            history = parallel.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            np.testing.assert_allclose(history.history["loss"], [expected], rtol=1e-5)
    finally:
        keras.utils.set_random_seed(0)
    assert iterator and parallel._engine._kept["fit"]._slot == iterator
    assert counts.iterators == 0

"""Repeated fits on the torch pool: the state travels as little as it
can -- rank 0 copies each variable straight into the state file, the driver copies
it straight from the file into the user's variables, and an unchanged model is not
sent to the workers again -- yet after every fit the user's model holds what plain
Keras's would, also when the user changed the weights, an optimizer slot or the
learning rate, or compiled again, between two fits.

4 simulated devices, the tests' MLP, one epoch of 4 steps per fit.
"""

import os

import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


def _state(model):
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


def _fit(ref, parallel, x, y):
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_fits_copy_in_only_what_the_user_changed_and_equal_plain_keras():
    import keras

    x, y = data("mlp", 32)
    ref, model = mlp(), mlp()
    for m in (ref, model):
        m.compile(optimizer="adam", loss="mse")
    parallel = kmgpu.parallelize(model)
    engine = parallel._engine
    with few_steps():
        _fit(ref, parallel, x, y)
    assert rel_diff(_state(ref), _state(model)) <= TOL
    _fit(ref, parallel, x, y)
    assert engine.copied_in == 0  # the workers hold the state the last fit left
    assert rel_diff(_state(ref), _state(model)) <= TOL

    def changed(change):
        for m in (ref, model):
            change(m)
        _fit(ref, parallel, x, y)
        assert engine.copied_in > 0, "the user's change did not reach the workers"
        assert rel_diff(_state(ref), _state(model)) <= TOL

    changed(lambda m: m.set_weights([w * 0.5 for w in m.get_weights()]))

    def optimizer(m):  # one Adam moment and the learning rate, through Keras's variable API
        m.optimizer.variables[2].assign(m.optimizer.variables[2].numpy() + 0.01)
        m.optimizer.learning_rate.assign(0.01)

    changed(optimizer)
    changed(lambda m: m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5),
                                loss="mse"))
    assert type(model.optimizer).__name__ == "SGD"
    _fit(ref, parallel, x, y)
    assert engine.copied_in == 0
    assert rel_diff(_state(ref), _state(model)) <= TOL
    parallel.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_state_goes_through_the_file_exactly_and_leaves_no_view_behind(dtype):
    """``replicas.write_state`` / ``load_arrays`` copy each variable once, straight
    to and from the file (a dtype numpy lacks takes Keras's own conversion), and
    the loaded model shares no memory with the file."""
    import keras

    from kmgpu.engines.torch import replicas
    from kmgpu.engines.torch import transport

    def model(seed):
        keras.utils.set_random_seed(seed)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, dtype=dtype),
                              keras.layers.Dense(2)])
        m.compile(optimizer="adam", loss="mse")
        m.optimizer.build(m.trainable_variables)
        return m

    def same(a, b):  # bit for bit (the file holds bfloat16 as raw bytes)
        return len(a) == len(b) and all(
            np.asarray(u).shape == np.asarray(w).shape
            and np.asarray(u).tobytes() == np.asarray(w).tobytes() for u, w in zip(a, b))

    src, dst = model(1), model(2)
    for v in src.optimizer.variables:  # non-zero moments, a step count, a learning rate
        v.assign(np.full(v.shape, 3, dtype=keras.backend.standardize_dtype(v.dtype)))
    layout, arrays = replicas.state_of(src, with_optimizer=True)
    state = transport.StateFile.make(layout.arrays)
    try:
        replicas.write_state(state, 1, src, layout, seq=1, epoch=0)
        assert same(state.read(1), arrays)
        want = replicas.model_arrays(src, layout)
        assert not same(replicas.model_arrays(dst, layout), want)
        replicas.load_arrays(dst, state.read(1, copy=False), layout)
        assert same(replicas.model_arrays(dst, layout), want)
        for view in state.begin(1):  # the file changes: the loaded model does not
            view[...] = np.zeros_like(view)
        assert same(replicas.model_arrays(dst, layout), want)
    finally:
        transport.remove(state.path.rsplit("/", 1)[0])


def test_a_freed_slot_gives_its_memory_back_and_reads_empty():
    """The state file's slots nothing will read give their pages back (an older snapshot,
    every slot after a call): the slot reads as empty, the others and the stop request stay,
    and a slot written again after it is whole."""
    from kmgpu.engines.torch import transport

    n = 1 << 20  # 4 MiB per array: whole pages
    layout = [((n,), "<f4"), ((3,), "<f4")]
    state = transport.StateFile.make(layout)
    try:
        ones = [np.ones(n, "f4"), np.ones(3, "f4")]
        for slot in (0, 1, 2):
            state.write(slot, [a * slot for a in ones], seq=slot)
        state.request_stop()
        before = os.stat(state.path).st_blocks
        state.free(1)
        assert state.read(1) is None and os.path.getsize(state.path) == 3 * state.slot_size
        assert os.stat(state.path).st_blocks < before  # tmpfs / the temp dir: punched
        assert [float(a[0]) for a in state.read(2)] == [2.0, 2.0]
        assert state.latest()[0][0][0] == 2.0 and state.stop_requested()
        state.write(1, [a * 5 for a in ones], seq=3)
        assert np.all(state.read(1)[0] == 5.0) and state.latest()[0][0][0] == 5.0
        state.free()
        assert all(state.read(s) is None for s in (0, 1, 2)) and state.latest() is None
        assert state.stop_requested()  # slot 0's header page stays
        assert os.stat(state.path).st_blocks * 512 < 64 << 10  # a few partial pages
    finally:
        transport.remove(state.path.rsplit("/", 1)[0])


def test_sharded_weights_write_no_snapshot_at_a_plain_epoch_end():
    """Under shard="weights" a snapshot is a whole copy of the state in host memory, so an
    epoch end writes one only when the driver's callbacks read the weights; the end of
    training and a stopped fit always write one. Unsharded, the first epoch end writes
    one (an interrupted fit keeps a recent epoch's state)."""
    from kmgpu.engines.torch.launch.snapshots import Snapshots

    def decide(pieces, every_epoch, epoch):
        snap = Snapshots(None, None, every_epoch, lambda *a, **k: None, pieces)
        return snap._decide(None, epoch, now=0.0)

    pieces = (object(), 0, "cpu")  # (zero.Shards, rank, device): only its presence counts
    assert decide(pieces, False, 0) == Snapshots.SKIP
    assert decide(pieces, True, 0) == Snapshots.WRITE
    assert decide(pieces, False, -1) == Snapshots.WRITE  # end of training
    assert decide(pieces, False, -2) == Snapshots.WRITE  # stopped early
    assert decide(None, False, 0) == Snapshots.WRITE


def _held(model):
    from kmgpu.engines.torch.optim import held

    return [held.held(v) for v in model.optimizer.variables]


def test_sharded_weights_keep_the_optimizer_slots_in_the_ranks_until_read(tmp_path):
    """shard="weights": after a fit your model holds the trained weights, and its
    optimizer's slots stay in the ranks (no copy in a snapshot, none in your model) until
    read. Each way of reading brings them back exactly as plain Keras's: a read of one
    variable (every slot comes), a later kmgpu fit that sends nothing, ``model.save``, a
    plain Keras ``fit`` on your model, closing the pool. A callback that may read the
    state gets them at its epoch end. Where the workers are gone, the slots
    start again from zeros, as a new optimizer's do, with a warning."""
    import warnings

    import keras

    x, y = data("mlp", 32)
    ref, model = mlp(), mlp()
    for m in (ref, model):
        m.compile(optimizer="adam", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=4, shard="weights")
        _fit(ref, parallel, x, y)
    slots = _held(model)
    assert sum(slots) == 8 and not slots[0] and not slots[1]  # 2 moments of 4 weights
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(_state(ref), _state(model)) <= TOL  # the first read brings every slot
    assert not any(_held(model))

    _fit(ref, parallel, x, y)  # the ranks still hold them: nothing sent, held again
    assert parallel._engine.copied_in == 0 and sum(_held(model)) == 8
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert rel_diff(_state(ref), _state(loaded)) <= TOL

    _fit(ref, parallel, x, y)
    assert sum(_held(model)) == 8
    for m in (ref, model):  # plain Keras on your model reads them itself
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(_state(ref), _state(model)) <= TOL

    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "c.keras"))
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    parallel.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[checkpoint])
    assert not any(_held(model))
    assert rel_diff(_state(ref), _state(keras.saving.load_model(tmp_path / "c.keras"))) <= TOL

    _fit(ref, parallel, x, y)
    assert sum(_held(model)) == 8
    parallel.close()  # the workers go: the slots come first
    assert not any(_held(model)) and rel_diff(_state(ref), _state(model)) <= TOL

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=4, shard="weights")
        _fit(ref, parallel, x, y)
    weights = model.get_weights()
    parallel._engine.launcher.pool.kill()  # a worker pool that died between calls
    with pytest.warns(RuntimeWarning, match="could not be read back"):
        after = [v.numpy() for v in model.optimizer.variables]
    assert not any(_held(model))
    assert all(not a.any() for a in after[2:])  # a new Adam's slots
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    parallel.close()


@pytest.mark.parametrize("shard", [None, "optimizer", "weights"])
def test_zero_slots_are_not_sent_and_the_ranks_make_them(shard):
    """A new optimizer's slots are zeros: slot 0 leaves them out and every rank makes them
    (its pieces, or its whole replica's), also on a replica that held other values, after
    your model's slots were set to zeros between fits. Slots that start elsewhere
    (Adagrad's accumulators at 0.1) travel. A call that writes no snapshot (evaluate,
    before any fit) leaves your model's new slots readable."""
    import warnings

    import keras

    x, y = data("mlp", 32)
    for make in (lambda: keras.optimizers.Adagrad(0.1), lambda: keras.optimizers.Adam(0.01)):
        ref, model = mlp(), mlp()
        for m in (ref, model):
            m.compile(optimizer=make(), loss="mse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel = kmgpu.parallelize(model, gpus=4, shard=shard)
            parallel.evaluate(x, y, batch_size=8, verbose=0)
            ref.optimizer.build(ref.trainable_variables)
            assert rel_diff(_state(ref), _state(model)) <= TOL
            _fit(ref, parallel, x, y)
        assert rel_diff(_state(ref), _state(model)) <= TOL
        for m in (ref, model):
            for v in m.optimizer.variables[2:]:
                v.assign(np.zeros(v.shape, "float32"))
        _fit(ref, parallel, x, y)
        assert parallel._engine.copied_in > 0
        assert rel_diff(_state(ref), _state(model)) <= TOL
        parallel.close()

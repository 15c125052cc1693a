"""``shard_optimizer=``: validated, refused up front where the backend has no sharded
optimizer (TensorFlow), a no-op said once on one device; ``use_ema`` sharded equals one
device on JAX and torch (TensorFlow refuses it as any other). Parity and memory of the
other options: ``tests/jax/test_zero.py``, ``tests/torch/test_zero.py``."""

import numpy as np
import pytest

import kmgpu
from kmgpu import hardware
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5


def test_not_a_bool_is_refused():
    with pytest.raises(TypeError, match="shard_optimizer must be True or False"):
        kmgpu.parallelize(mlp(), shard_optimizer="yes")


@pytest.mark.parametrize("shard", ["all", True, "weight"])
def test_an_unknown_shard_value_is_refused(shard):
    with pytest.raises(ValueError, match="pass None .* 'optimizer' .* 'gradients' .* 'weights'"):
        kmgpu.parallelize(mlp(), shard=shard)


def test_shard_optimizer_is_shard_optimizer_value():
    """``shard_optimizer=True`` is ``shard="optimizer"``; beside another value it is refused."""
    from kmgpu import plan

    assert plan.options(shard_optimizer=True)["shard"] == "optimizer"
    assert plan.options(shard="optimizer", shard_optimizer=True)["shard"] == "optimizer"
    with pytest.raises(ValueError, match="shard_optimizer=True is shard='optimizer', but "
                                         "shard='weights' was passed too"):
        kmgpu.parallelize(mlp(), shard="weights", shard_optimizer=True)


def test_refused_before_any_work_or_sharded():
    """TensorFlow refuses before any work; JAX and torch take it."""
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    if hardware.backend_name() in ("jax", "torch"):
        parallel = kmgpu.parallelize(model, shard_optimizer=True)
        text = str(parallel.describe())
        assert "optimizer state: 1/4 per device, bytes known once" in text
        assert "shard='optimizer'" in text
        for a, b in zip(before, model.get_weights()):
            assert np.array_equal(a, b)
        return
    for shard in ("optimizer", "gradients", "weights"):
        with pytest.raises(NotImplementedError, match="MirroredStrategy keeps a whole copy"
                           ) as e:
            kmgpu.parallelize(model, shard=shard)
        assert f"shard={shard!r}" in str(e.value)
        assert "The JAX and torch backends shard" in str(e.value)
    with pytest.raises(NotImplementedError, match="shard='optimizer'"):
        kmgpu.parallelize(model, shard_optimizer=True)
    assert not model.optimizer.built  # nothing ran: no optimizer state was made
    for a, b in zip(before, model.get_weights()):
        assert np.array_equal(a, b)


def test_an_unbuilt_model_is_checked_up_front_too():
    """An unbuilt Sequential is built at its first batch; shard_optimizer is judged at wrap."""
    import keras

    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    if hardware.backend_name() in ("jax", "torch"):
        parallel = kmgpu.parallelize(model, shard_optimizer=True)
        assert not model.built and parallel.num_replicas == 4
    else:
        with pytest.raises(NotImplementedError, match="The JAX and torch backends shard"):
            kmgpu.parallelize(model, shard_optimizer=True)
        assert not model.built


def _ema_model(every):
    import keras

    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=True,
                                                  ema_overwrite_frequency=every),
                  loss="mse", metrics=["mae"])
    return model


def _state(model):
    import keras

    return [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables]


def _averages(model):
    import keras

    return [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables
            if v.path.endswith("_average")]


def _assert_same(ref, model, ref_history, history):
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(_state(ref), _state(model)) <= TOL  # the moving averages included
    assert ref_history.keys() == history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=TOL, err_msg=key)


def _copied(model):
    """Keras's own JAX fit leaves each weight holding its average's array, which its next
    (donated) step, evaluate's included, deletes or gets twice: the one-device reference
    goes on from copies."""
    import keras

    for v in model.trainable_variables:
        v.assign(keras.ops.convert_to_numpy(v.value))


@pytest.mark.parametrize("n, every", [(2, 3), (4, None)],
                         ids=["2_devices_overwrite_every_3", "4_devices"])
def test_use_ema_sharded_equals_one_device(n, every, tmp_path):
    """``use_ema`` with the state sharded: fit ends with Keras's
    ``finalize_variable_values`` on every torch rank (each weight assigned its whole
    moving average), so every rank needs the averages whole then. 34 rows at batch 8: 5
    steps an epoch, the last of 2 rows (stand-in rows on 4 devices); 10 steps, not a
    multiple of 3, so the weights after fit are the averages only by that overwrite.
    Weights, History and every optimizer variable equal one device (1e-5); then a second
    fit, evaluate, predict, and the saved model loaded and trained on, as one device."""
    import keras

    if hardware.backend_name() == "tensorflow":
        with pytest.raises(NotImplementedError, match="MirroredStrategy keeps a whole "
                                                      "copy"):
            kmgpu.parallelize(_ema_model(every), gpus=n, shard_optimizer=True)
        return
    x, y = data("mlp", 34)
    fit = dict(batch_size=8, shuffle=False, verbose=0)
    ref, model = _ema_model(every), _ema_model(every)
    parallel = kmgpu.parallelize(model, gpus=n, shard_optimizer=True)
    try:
        ref_history = ref.fit(x, y, epochs=2, **fit).history
        _copied(ref)
        with few_steps():
            history = parallel.fit(x, y, epochs=2, **fit).history
        assert f"(1/{n} of" in str(parallel.describe())  # measured
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations.value)) == 10
        _assert_same(ref, model, ref_history, history)
        assert len(_averages(model)) == len(model.trainable_variables)
        assert rel_diff(_averages(model), model.get_weights()) == 0.0  # fit's overwrite
        assert rel_diff(mlp().get_weights(), model.get_weights()) > 1e-2  # it trained

        model.save(tmp_path / "sharded.keras")
        ref_eval = ref.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        evaluated = parallel.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        for key in ref_eval:
            np.testing.assert_allclose(evaluated[key], ref_eval[key], rtol=TOL, err_msg=key)
        assert rel_diff([ref.predict(x, batch_size=8, verbose=0)],
                        [parallel.predict(x, batch_size=8, verbose=0)]) <= TOL

        ref_history = ref.fit(x, y, epochs=1, **fit).history
        history = parallel.fit(x, y, epochs=1, **fit).history
        _assert_same(ref, model, ref_history, history)
    finally:
        parallel.close()

    loaded = keras.saving.load_model(tmp_path / "sharded.keras")
    again = kmgpu.parallelize(loaded, gpus=n, shard_optimizer=True)
    try:
        with few_steps():
            history = again.fit(x, y, epochs=1, **fit).history
    finally:
        again.close()
    _assert_same(ref, loaded, ref_history, history)

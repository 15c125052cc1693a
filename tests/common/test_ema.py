"""``use_ema``, with and without ``ema_overwrite_frequency``: N devices equal one device
(weights, every optimizer variable with the moving averages, History), in a first fit and
in a second fit of the same ParallelModel. On torch the ParallelModel runs kmgpu's
own flat optimizer, which computes the averages itself.

The second fit starts from the state the first one leaves: each trainable variable
overwritten with its average. Keras's JAX fit leaves a variable and its average holding
one array, which the next donated train step received twice (a segfault on 4 devices).
4 devices on JAX and torch; 2 on TensorFlow, whose tracing costs twice as much on 4 and
whose averages are the same code on any count."""

import keras
import numpy as np
import pytest

import kmgpu
from tests.helpers import data, few_steps, mlp, rel_diff

TOL = 1e-5
GPUS = 2 if keras.backend.backend() == "tensorflow" else 4


def compiled(every, jit_compile="auto"):
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=True,
                                                  ema_overwrite_frequency=every), loss="mse",
                  jit_compile=jit_compile)
    return model


def optimizer_state(model):
    return [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables]


def assert_same(ref, model, ref_history, history):
    averages = [v for v in model.optimizer.variables if v.path.endswith("_average")]
    assert len(averages) == len(model.trainable_variables)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff(optimizer_state(ref), optimizer_state(model)) <= TOL
    assert ref_history.keys() == history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=TOL)


@pytest.mark.parametrize("every", [None, 3], ids=["no_overwrite", "overwrite_every_3"])
def test_ema_equals_one_device(every):
    x, y = data("mlp", 48)
    fit = dict(batch_size=8, shuffle=False, verbose=0)
    # torch: jit_compile=True runs kmgpu's split step and its own flat optimizer (its GPU
    # path) on a CPU too; the reference stays Keras's eager step
    ref = compiled(every)
    model = compiled(every, jit_compile=True if keras.backend.backend() == "torch" else "auto")
    parallel = kmgpu.parallelize(model, gpus=GPUS)

    ref_history = ref.fit(x, y, epochs=2, **fit).history
    with few_steps():
        history = parallel.fit(x, y, epochs=2, **fit).history
    assert_same(ref, model, ref_history, history)

    # Keras's own JAX fit would fail here on the shared arrays: the reference gets copies
    for v in ref.trainable_variables:
        v.assign(keras.ops.convert_to_numpy(v.value))
    ref_history = ref.fit(x, y, epochs=1, **fit).history
    history = parallel.fit(x, y, epochs=1, **fit).history
    assert_same(ref, model, ref_history, history)

"""A sharded train step on CPU devices holds one layer's whole weights and gradients at a
time, not every layer's (``step_fixes.SHARDED_CPU_OPTIONS``, given per computation).

- XLA still honours the options: a sharded gradient step of a Dense stack compiled with
  them needs a fraction of the temporary bytes it needs without (an option XLA does not
  know, such as a renamed pass, would be ignored silently).
- kmgpu compiles the replica's steps with them under ``shard="gradients"`` and
  ``"weights"``, and with none under ``shard=None``.
"""

import os
import warnings

import numpy as np
import pytest

import kmgpu
from kmgpu.engines.jax import step_fixes

DEPTH, WIDTH = 6, 512


def _temp_bytes(options):
    """Per-device temporary bytes of a compiled step: the loss's gradient of a relu Dense
    stack, weights and gradients sharded over the devices, the batch along its rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d", None))

    def loss(ws, x):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.sum(x * x)

    def step(ws, x):
        return [jax.lax.with_sharding_constraint(g, rows) for g in jax.grad(loss)(ws, x)]

    ws = [jax.device_put(jnp.full((WIDTH, WIDTH), 1e-3), rows) for _ in range(DEPTH)]
    x = jax.device_put(jnp.ones((32, WIDTH)), rows)
    lowered = jax.jit(step, out_shardings=[rows] * DEPTH).lower(ws, x)
    return lowered.compile(compiler_options=options).memory_analysis().temp_size_in_bytes


def test_options_keep_one_layer_whole():
    whole = DEPTH * WIDTH * WIDTH * 4  # every layer's weights (or gradients), whole
    assert _temp_bytes({}) >= 1.9 * whole  # all weights gathered, all gradients summed
    assert _temp_bytes(step_fixes.SHARDED_CPU_OPTIONS) <= 0.5 * whole


def test_options_keep_the_users_disabled_passes():
    options = step_fixes.cpu_options("--xla_cpu_use_thunk_runtime=true "
                                     "--xla_disable_hlo_passes=foo,bar")
    assert options["xla_disable_hlo_passes"] == "foo,bar,cpu-all-reduce-combiner"
    assert step_fixes.cpu_options("")["xla_disable_hlo_passes"] == "cpu-all-reduce-combiner"


def test_an_option_this_xla_does_not_take_is_left_out(monkeypatch):
    """An XLA that does not know an option (an older jaxlib) would fail every step's
    compile: the option is left out, the others kept."""
    monkeypatch.setitem(step_fixes.SHARDED_CPU_OPTIONS, "xla_no_such_option_here", True)
    options = step_fixes.cpu_options("")
    assert "xla_no_such_option_here" not in options
    assert options == {k: v for k, v in step_fixes.SHARDED_CPU_OPTIONS.items()
                       if k != "xla_no_such_option_here"}


@pytest.mark.parametrize("shard", [None, "gradients", "weights"], ids=str)
def test_replica_steps_compiled_with_options(shard, monkeypatch):
    import keras
    from keras.src.backend.jax import trainer

    seen = []
    jit = trainer.jit

    def recording(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return jit(fun, **kwargs)

    monkeypatch.setattr(trainer, "jit", recording)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few steps per epoch
        parallel = kmgpu.parallelize(model, shard=shard)
        parallel.fit(x, x, batch_size=16, epochs=1, verbose=0)
        parallel.predict(x, batch_size=16, verbose=0)
    assert len(seen) >= 2  # the train and the predict step
    expected = (None if shard is None
                else step_fixes.cpu_options(os.environ.get("XLA_FLAGS", "")))
    assert all(options == expected for options in seen), seen

"""shard="weights" in a pool: a rank makes its replica's trainable weights and optimizer
slots without memory (``optim.unfilled``) and the state file fills its pieces, so the
result is one device's exactly: with a frozen layer (its weights are not sharded: they
get memory back) and a LoRA layer (its adapters are made after the build)."""

import keras
import numpy as np

import kmgpu
from kmgpu.engines.torch import replicas
from kmgpu.engines.torch.optim import unfilled
from tests.helpers import rel_diff

TOL = 1e-5


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.layers[0].trainable = False
    model.layers[1].enable_lora(2)
    return model


def test_a_replica_made_unfilled_holds_no_trainable_memory():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)])
    spec, _ = replicas.model_spec(model)
    replica = replicas.FromSpec(spec, unfilled=True).model(lambda b: b)
    assert all(unfilled.is_unfilled(v) for v in replica.trainable_weights)
    assert sum(v.value.untyped_storage().nbytes() for v in replica.trainable_weights) == 0
    opt = keras.optimizers.Adam()
    with unfilled.unfilled(unfilled.float_tensor):
        opt.build(replica.trainable_weights)
    assert all(unfilled.is_unfilled(v) for v in opt.variables if len(v.shape))
    assert int(opt.iterations.numpy()) == 0  # a scalar keeps its memory and value


def test_a_frozen_and_a_lora_layer_train_as_on_one_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")  # 12 steps an epoch
    y = x[:, :1] * 0.5
    ref = _model()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _model()
    parallel = kmgpu.parallelize(model, gpus=2, shard="weights")
    parallel.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    parallel.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert rel_diff(ref.get_weights(), model.get_weights()) <= TOL
    assert rel_diff([v.numpy() for v in ref.optimizer.variables],
                    [v.numpy() for v in model.optimizer.variables]) <= TOL

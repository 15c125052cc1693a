"""describe()'s memory line says where a sharded piece is larger than 1/N (alignment
padding, a variable kept whole), so its figures add up; its BatchNorm line appears only
for a model that has BatchNormalization."""

import types

import pytest

from kmgpu import plan

pytestmark = pytest.mark.backend_neutral  # plain text from stand-ins: one session is enough


def _model(batchnorm):
    import keras

    layers = [keras.Input((8,)), keras.layers.Dense(32)]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    return keras.Sequential(layers + [keras.layers.Dense(1)])


class _Engine:
    """An engine of 4 replicas whose pieces of the weights are ``per`` bytes each."""
    num_replicas, name, device_names = 4, "stand-in", ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]

    def __init__(self, per):
        self.per = per

    def sharded_bytes(self, template, kind):
        if kind != "weights":
            return None
        whole = sum(int(v.numpy().nbytes) for v in template.weights)
        return self.per, whole, 0

    def batchnorm_mode(self):
        return "per replica"

    def train_step_mode(self, template):
        return None


def _text(model, per):
    config = types.SimpleNamespace(batch="global", scale_lr=False, warmup_epochs=0,
                                   shard="weights")
    return plan.describe(backend="jax", engine=_Engine(per), config=config, template=model)


def test_padding_in_a_piece_is_named():
    model = _model(batchnorm=False)
    whole = sum(int(v.numpy().nbytes) for v in model.weights)  # 1,284 B: 321 per device
    line = next(ln for ln in _text(model, 512).splitlines() if "memory/device" in ln)
    assert (f"weights 512 B (1/4 of {plan._bytes(whole)}, {512 - whole // 4} B of it "
            "padding") in line, line
    exact = next(ln for ln in _text(model, whole // 4).splitlines() if "memory/device" in ln)
    assert "padding" not in exact, exact


def test_the_batchnorm_line_only_where_there_is_batchnorm():
    assert "BatchNorm" not in _text(_model(batchnorm=False), 1024)
    assert "  BatchNorm " in _text(_model(batchnorm=True), 1024)

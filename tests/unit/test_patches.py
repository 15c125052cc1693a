"""``swapped`` and ``install``, the one way kmgpu changes Keras, put back what they change
and nest."""

import types

import pytest

from kmgpu.engines import keras_fixes


class _Base:
    def inherited(self):
        return "base"


class _Owner(_Base):
    def own(self):
        return "own"


def test_swapped_nests_and_puts_back():
    module = types.ModuleType("example")
    module.f = original = lambda: "keras"
    made = []

    def make(before):
        made.append(before)
        return lambda: "kmgpu"

    with keras_fixes.swapped((module, "f", make)):
        assert module.f() == "kmgpu"
        with keras_fixes.swapped((module, "f", lambda before: lambda: "inner")):
            assert module.f() == "kmgpu"  # a nested block keeps the outer replacement
        assert module.f() == "kmgpu"  # the inner block's end leaves it
    assert module.f is original and made == [original]
    with pytest.raises(RuntimeError):
        with keras_fixes.swapped((module, "f", make)):
            raise RuntimeError("in the block")
    assert module.f is original and not keras_fixes._ACTIVE


def test_swapped_deletes_an_inherited_attribute_and_leaves_nothing_half_done():
    with keras_fixes.swapped((_Owner, "inherited", lambda before: lambda self: "swapped")):
        assert _Owner().inherited() == "swapped"
    assert "inherited" not in vars(_Owner) and _Owner().inherited() == "base"

    def fails(before):
        raise ValueError("cannot make it")

    with pytest.raises(ValueError):
        with keras_fixes.swapped((_Owner, "own", lambda before: lambda self: "new"),
                                 (_Owner, "inherited", fails)):
            pass
    assert _Owner().own() == "own" and "inherited" not in vars(_Owner)
    assert not keras_fixes._ACTIVE


def test_install_sets_for_good_once_per_key():
    owner, module = _Owner(), types.ModuleType("example")
    module.g = lambda: 1
    assert keras_fixes.install(owner, "own", lambda before: lambda: before() + "!",
                               key="loud")
    assert not keras_fixes.install(owner, "own", lambda before: lambda: "again", key="loud")
    assert owner.own() == "own!" and "own" in vars(owner)
    assert keras_fixes.install(owner, "own", lambda before: lambda: before() + "?")
    assert owner.own() == "own!?" and _Owner().own() == "own"
    keras_fixes.install(module, "g", lambda before: lambda: before() + 1, key="plus")
    keras_fixes.install(module, "g", lambda before: lambda: before() + 1, key="plus")
    assert module.g() == 2

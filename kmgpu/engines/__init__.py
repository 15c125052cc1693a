"""One engine per backend, imported only when that backend is active."""

import importlib

_ENGINES = {
    "tensorflow": ("kmgpu.engines.tensorflow", "TensorFlowEngine"),
    "jax": ("kmgpu.engines.jax", "JaxEngine"),
    "torch": ("kmgpu.engines.torch", "TorchEngine"),
}


def engine_class(backend):
    """The Engine subclass for a Keras backend name."""
    if backend not in _ENGINES:
        raise ValueError(
            f"kmgpu runs on the tensorflow, jax and torch backends; this process uses "
            f"{backend!r}. Set KERAS_BACKEND to one of them before importing keras."
        )
    module, name = _ENGINES[backend]
    return getattr(importlib.import_module(module), name)

"""One folder per backend, imported only when that backend is active.

Each ``kmgpu/engines/<backend>/`` has the same modules, as Keras's own
``keras/src/backend/<backend>/``:

- ``engine.py``: the Engine subclass (how replicas are made and synchronised);
- ``runtime.py``: the same plain functions on every backend -- ``physical_devices()``,
  ``simulate(n)``, ``peak_memory()``, ``reset_peak_memory()``, ``start_job(job)``;
- ``keras_fixes.py``: the backend's Keras-patch registry, one table (``PATCHES``) of every
  Keras internal kmgpu replaces, wraps or calls, with why, and the private attributes it
  only reads (``READS``); the code is in role modules named alike on every backend
  (``step_fixes.py``, ``data_fixes.py``, ``layer_fixes.py``, ``optimizer_fixes.py``).
  ``engines/keras_fixes.py`` holds the rows every backend shares and the one way kmgpu
  changes Keras: ``swapped`` (for a block) and ``install`` (for good).

``base.py`` is the interface, ``local.py`` the one-device engine (plain Keras).
"""

import importlib

BACKENDS = ("tensorflow", "jax", "torch")
_ENGINES = {
    "tensorflow": "TensorFlowEngine",
    "jax": "JaxEngine",
    "torch": "TorchEngine",
}


def _check(backend):
    if backend not in _ENGINES:
        raise ValueError(
            f"kmgpu runs on the tensorflow, jax and torch backends; this process uses "
            f"{backend!r}. Set KERAS_BACKEND to one of them before importing keras."
        )


def engine_class(backend):
    """The Engine subclass for a Keras backend name."""
    _check(backend)
    module = importlib.import_module(f"kmgpu.engines.{backend}.engine")
    return getattr(module, _ENGINES[backend])


def runtime(backend):
    """The backend's ``runtime`` module: devices, simulation, memory, multi-process start.

    Importing it imports no backend; its functions do.
    """
    _check(backend)
    return importlib.import_module(f"kmgpu.engines.{backend}.runtime")

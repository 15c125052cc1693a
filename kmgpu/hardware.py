"""Which devices kmgpu uses: ``gpus=...`` -> a device list, and ``simulate_devices``.

The backend-neutral half: each backend lists and simulates its devices in its
engine's ``runtime`` module (``kmgpu/engines/<backend>/runtime.py``). Nothing here
imports a backend at module import time. The active backend is read from Keras's
own configuration (``KERAS_BACKEND`` or ``~/.keras/keras.json``) so that
``simulate_devices`` can run before Keras is imported.
"""

import json
import os
import sys

from kmgpu import environment

_SHOWN = {"jax": "JAX", "tensorflow": "TensorFlow", "torch": "torch"}


def backend_name():
    """The Keras backend this process uses, without importing a backend if possible.

    Returns:
        "tensorflow", "jax" or "torch".
    """
    if "keras" in sys.modules:
        import keras

        return keras.config.backend()
    name = os.environ.get("KERAS_BACKEND")
    if not name:
        path = os.path.join(
            os.environ.get("KERAS_HOME", os.path.expanduser("~/.keras")), "keras.json"
        )
        try:
            with open(path) as f:
                name = json.load(f).get("backend")
        except (OSError, ValueError):
            name = None
    return name or "tensorflow"


def simulate_devices(n):
    """Make ``n`` virtual CPU devices stand in for GPUs.

    TensorFlow gets ``n`` logical CPU devices, JAX ``n`` host devices
    (``--xla_force_host_platform_device_count``), torch ``n`` gloo processes.
    Call it before the backend first touches its devices.

    Args:
        n: number of devices, an int >= 1.

    Raises:
        TypeError / ValueError: ``n`` is not a positive int.
        RuntimeError: the backend already initialised its devices with another count.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"simulate_devices(n) takes an int >= 1, got {n!r}.")
    if n < 1:
        raise ValueError(f"simulate_devices(n) takes an int >= 1, got {n}.")
    backend = backend_name()
    runtime = _runtime(backend)
    have = runtime.simulate(n) if runtime is not None else None
    if have is not None:
        raise _too_late(n, backend, have)
    os.environ[environment.SIMULATE_ENV] = str(n)  # torch workers and child processes read this


def _runtime(backend):
    """The backend's ``runtime`` module (devices, simulation), or None for another backend."""
    from kmgpu import engines

    try:
        return engines.runtime(backend)
    except ValueError:
        return None


def _too_late(n, backend, have):
    return RuntimeError(
        f"simulate_devices({n}) came after {_SHOWN.get(backend, backend)} had already set up its devices "
        f"({have}). Call kmgpu.simulate_devices({n}) first, before building any model "
        "or touching the backend (in a notebook: restart the kernel and make it the "
        "first cell after the imports)."
    )


def physical_devices(backend=None):
    """The devices ``gpus=None`` would use on this backend.

    Returns:
        A list of (kind, index) pairs, e.g. [("gpu", 0), ("gpu", 1)] or [("cpu", 0)].
    """
    backend = backend or backend_name()
    runtime = _runtime(backend)
    if runtime is None:
        raise ValueError(f"kmgpu supports the tensorflow, jax and torch backends, not {backend!r}.")
    return runtime.physical_devices()


def devices():
    """The devices ``gpus=None`` would use, as strings, e.g. ['gpu:0', 'gpu:1']."""
    return [f"{kind}:{i}" for kind, i in physical_devices()]


def resolve(gpus, available):
    """Turn the user's ``gpus`` argument into the list of device indices to use.

    Args:
        gpus: None (all; also "all", "auto", -1 as Lightning's ``devices=``), an int
            N (the first N), a list/tuple of ids, or a Chainer-style dict such as {'main': 0, 'second': 1}.
        available: list of (kind, index) pairs from ``physical_devices``.

    Returns:
        A list of indices into ``available``, the main device first.

    Raises:
        TypeError / ValueError with what to pass instead.
    """
    count = len(available)
    if gpus is None or _means_all(gpus):
        return list(range(count))
    if isinstance(gpus, bool):
        raise TypeError(f"gpus must be None, an int, a list of ids or a dict, not {gpus!r}.")
    if isinstance(gpus, str):
        raise TypeError(
            f"gpus={gpus!r}: a string means every device only as 'all', 'auto' or '-1'; "
            "pass None (or 'all', -1) for all, an int N for the first N, or a list of ids "
            "such as [0, 2]."
        )
    if isinstance(gpus, int):
        if gpus < 1:
            raise ValueError(
                f"gpus={gpus}: ask for at least 1 device, or pass gpus=None for all {count}."
            )
        if gpus > count:
            raise ValueError(_too_many(gpus, available))
        return list(range(gpus))
    if isinstance(gpus, dict):
        if "main" not in gpus:
            raise ValueError(
                f"gpus={gpus!r} has no 'main' entry: name the device that holds the "
                "model, e.g. {'main': 0, 'second': 1}."
            )
        ids = [gpus["main"]] + [v for k, v in gpus.items() if k != "main"]
    elif isinstance(gpus, (list, tuple)):
        ids = list(gpus)
        if not ids:
            raise ValueError("gpus=[] names no device: pass e.g. [0, 1], or None for all.")
    else:
        raise TypeError(
            f"gpus must be None, an int, a list of ids such as [0, 2] or a dict such as "
            f"{{'main': 0, 'second': 1}}, not {type(gpus).__name__}."
        )
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"device ids must be ints, got {i!r} in gpus={gpus!r}.")
        if i < 0 or i >= count:
            raise ValueError(
                f"device id {i} in gpus={gpus!r} does not exist: this machine has "
                f"ids 0..{count - 1} ({', '.join(f'{k}:{j}' for k, j in available)})."
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpus={gpus!r} names a device twice: list each id once.")
    return ids


ALL_DEVICES = ("all", "auto", "-1", -1)  # what Keras / Lightning users type for "every device"


def _means_all(gpus):
    """True for the spellings of "every device" (None is kmgpu's own)."""
    if isinstance(gpus, str):
        return gpus.strip().lower() in ALL_DEVICES
    return not isinstance(gpus, bool) and isinstance(gpus, int) and gpus == -1


def _too_many(n, available):
    hint = ""
    if available and available[0][0] == "cpu":
        hint = f" On a machine without GPUs, call kmgpu.simulate_devices({n}) first."
    return (
        f"gpus={n} asks for more devices than exist ({len(available)}: "
        f"{', '.join(f'{k}:{j}' for k, j in available)}). Pass gpus=None to use all.{hint}"
    )

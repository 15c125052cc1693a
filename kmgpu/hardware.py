"""Which devices kmgpu uses: ``gpus=...`` -> a device list, and ``simulate_devices``.

Nothing here imports a backend at module import time. The active backend is
read from Keras's own configuration (``KERAS_BACKEND`` or ``~/.keras/keras.json``)
so that ``simulate_devices`` can run before Keras is imported.
"""

import json
import os
import sys

SIMULATE_ENV = "KMGPU_SIMULATE_DEVICES"


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


def simulated_count():
    """The number of simulated devices asked for, or 0."""
    try:
        return max(0, int(os.environ.get(SIMULATE_ENV, "0")))
    except ValueError:
        return 0


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
    if backend == "jax":
        _simulate_jax(n)
    elif backend == "tensorflow":
        _simulate_tensorflow(n)
    elif backend == "torch" and simulated_count() not in (0, n) and "keras" in sys.modules:
        # engines and worker pools already exist for the old count
        raise _too_late(n, "torch", f"{simulated_count()} simulated device(s)")
    os.environ[SIMULATE_ENV] = str(n)  # torch workers and child processes read this


def _too_late(n, backend, have):
    return RuntimeError(
        f"simulate_devices({n}) came after {backend} had already set up its devices "
        f"({have}). Call kmgpu.simulate_devices({n}) first, before building any model "
        "or touching the backend (in a notebook: restart the kernel and make it the "
        "first cell after the imports)."
    )


def _simulate_jax(n):
    flag = f"--xla_force_host_platform_device_count={n}"
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            have = jax.devices()
            if len(have) == n and have[0].platform == "cpu":
                return
            raise _too_late(n, "JAX", f"{len(have)} {have[0].platform} device(s)")
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
    os.environ["JAX_PLATFORMS"] = "cpu"


def _simulate_tensorflow(n):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = tf.config.list_logical_devices("CPU")
        if len(have) == n and not tf.config.list_logical_devices("GPU"):
            return
        raise _too_late(n, "TensorFlow", f"{len(have)} CPU device(s)") from None


def physical_devices(backend=None):
    """The devices ``gpus=None`` would use on this backend.

    Returns:
        A list of (kind, index) pairs, e.g. [("gpu", 0), ("gpu", 1)] or [("cpu", 0)].
    """
    backend = backend or backend_name()
    n_sim = simulated_count()
    if backend == "jax":
        import jax

        devs = jax.devices()
        return [(d.platform if d.platform != "cuda" else "gpu", i) for i, d in enumerate(devs)]
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            return [("gpu", i) for i in range(len(gpus))]
        return [("cpu", i) for i in range(len(tf.config.list_logical_devices("CPU")))]
    if backend == "torch":
        import torch

        if n_sim:
            return [("cpu", i) for i in range(n_sim)]
        if torch.cuda.is_available():
            return [("gpu", i) for i in range(torch.cuda.device_count())]
        return [("cpu", 0)]
    raise ValueError(f"kmgpu supports the tensorflow, jax and torch backends, not {backend!r}.")


def devices():
    """The devices ``gpus=None`` would use, as strings, e.g. ['gpu:0', 'gpu:1']."""
    return [f"{kind}:{i}" for kind, i in physical_devices()]


def resolve(gpus, available):
    """Turn the user's ``gpus`` argument into the list of device indices to use.

    Args:
        gpus: None (all), an int N (the first N), a list/tuple of ids, or a
            Chainer-style dict such as {'main': 0, 'second': 1}.
        available: list of (kind, index) pairs from ``physical_devices``.

    Returns:
        A list of indices into ``available``, the main device first.

    Raises:
        TypeError / ValueError with what to pass instead.
    """
    count = len(available)
    if gpus is None:
        return list(range(count))
    if isinstance(gpus, bool):
        raise TypeError(f"gpus must be None, an int, a list of ids or a dict, not {gpus!r}.")
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


def _too_many(n, available):
    hint = ""
    if available and available[0][0] == "cpu":
        hint = f" On a machine without GPUs, call kmgpu.simulate_devices({n}) first."
    return (
        f"gpus={n} asks for more devices than exist ({len(available)}: "
        f"{', '.join(f'{k}:{j}' for k, j in available)}). Pass gpus=None to use all.{hint}"
    )

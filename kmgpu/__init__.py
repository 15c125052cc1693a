"""kmgpu: multi-GPU training for Keras 3 in one line, on TensorFlow, JAX and torch.

    import kmgpu
    parallel = kmgpu.parallelize(model, gpus=None)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x, y, batch_size=256, epochs=20)   # `model` now holds the trained weights

Importing kmgpu imports no backend.
"""

from kmgpu.hardware import devices, simulate_devices

__version__ = "0.1.0"
__all__ = ["devices", "simulate_devices", "parallelize", "ParallelModel", "rebatch"]


def __getattr__(name):
    if name in ("parallelize", "ParallelModel", "rebatch"):
        from kmgpu import api

        return getattr(api, name)
    raise AttributeError(f"module 'kmgpu' has no attribute {name!r}")

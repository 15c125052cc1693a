"""kmgpu: multi-GPU training for Keras 3 in one line, on TensorFlow, JAX and torch.

    import kmgpu
    parallel = kmgpu.parallelize(model, gpus=None)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x, y, batch_size=256, epochs=20)   # `model` now holds the trained weights

In a job of several processes (``kmgpu launch``, torchrun, srun), ``kmgpu.is_main_process()``
and ``@kmgpu.main_process_only`` make your own prints and loggers act once.

Importing kmgpu imports no backend.
"""

from kmgpu.environment import is_main_process, main_process_only, process_count, process_index
from kmgpu.hardware import devices, simulate_devices

__version__ = "0.1.0"
__all__ = ["devices", "simulate_devices", "parallelize", "ParallelModel", "rebatch",
           "process_index", "process_count", "is_main_process", "main_process_only",
           "ShardedCheckpoint", "checkpoints"]


def __getattr__(name):
    if name in ("parallelize", "ParallelModel", "rebatch"):
        from kmgpu import api

        return getattr(api, name)
    if name in ("ShardedCheckpoint", "checkpoints"):  # they import Keras
        import importlib

        module = importlib.import_module("kmgpu.checkpoints")
        return module if name == "checkpoints" else module.ShardedCheckpoint
    raise AttributeError(f"module 'kmgpu' has no attribute {name!r}")

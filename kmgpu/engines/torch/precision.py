"""The float32 matmul policy of kmgpu's torch steps: a precision setting beside Keras's
mixed precision (dtype policies, ``LossScaleOptimizer``), as Lightning Fabric keeps
precision in plugins of its own, apart from how steps are captured or run.

JAX and TensorFlow use TF32 for float32 matrix products on Ampere and Hopper GPUs by
default; torch does not (``torch.backends.cuda.matmul.allow_tf32`` is False, cuDNN
convolutions do use TF32). kmgpu's torch steps use TF32 like the other two backends by
default (``parallelize(..., tf32=False)``: full float32 for matmuls and convolutions),
set only while kmgpu's step runs (``matmul_precision``, inside ``graphs.step_context``;
captured graphs keep the kernels chosen at capture), so the user's other torch code
keeps its own global settings. The policy reaches every rank in the run's record
(``Config.tf32``, ``kmgpu.engines.base``).
"""

import contextlib

import torch

#: the default: TF32 for float32 matmuls and convolutions, as JAX and TensorFlow on GPUs
TF32_DEFAULT = True


@contextlib.contextmanager
def matmul_precision(tf32):
    """Within the block, float32 matmuls and cuDNN convolutions use TF32 (``tf32``
    True) or full float32 (False); the global settings are put back after it; set
    also without CUDA, where they change nothing (a CPU rank shows the policy it got).
    None: the process's own settings, untouched."""
    if tf32 is None:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = bool(tf32)
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def words(tf32):
    """describe()'s words for the policy."""
    if tf32 is False:
        return ("float32 matmuls and convolutions in full float32 (tf32=False; TF32 with "
                "parallelize(..., tf32=True), the default)")
    return ("float32 matmuls and convolutions in TF32 inside kmgpu's steps, as JAX and "
            "TensorFlow do on GPUs (about 1e-3 relative per product; full float32 with "
            "parallelize(..., tf32=False))")

"""The batch policy and the printed plan.

``Options`` holds what the user chose in ``parallelize``; ``Plan`` turns it and a
fit call into numbers (global and per-replica batch, steps per epoch, learning-rate
factor, bytes all-reduced) and says them as text in ``describe()``.
"""

import dataclasses
import math

BATCH_POLICIES = ("global", "per_replica")
RESET_CHOICES = ("epoch", None)  # stateful RNNs: zero the states each epoch, or never
KERAS_DEFAULT_BATCH = 32


@dataclasses.dataclass(frozen=True)
class Options:
    batch: str = "global"
    scale_lr: bool = False
    warmup_epochs: int = 0
    sync_batchnorm: bool = False
    reset_states: str = "epoch"
    drop_remainder: bool = False

    @classmethod
    def make(cls, batch="global", scale_lr=None, warmup_epochs=0, sync_batchnorm=False,
             reset_states="epoch", drop_remainder=False):
        """Validate the user's choices; raise ValueError/TypeError saying what to pass."""
        if batch not in BATCH_POLICIES:
            raise ValueError(
                f"batch={batch!r}: pass batch='global' (fit's batch_size is the global "
                "batch; N devices train like one) or batch='per_replica' (batch_size per "
                "device, global batch = N x batch_size)."
            )
        if scale_lr is None:
            scale_lr = batch == "per_replica"
        if not isinstance(scale_lr, bool):
            raise TypeError(f"scale_lr must be True, False or None, not {scale_lr!r}.")
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int):
            raise TypeError(f"warmup_epochs must be an int >= 0, not {warmup_epochs!r}.")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={warmup_epochs}: pass 0 (no warm-up) or more.")
        if warmup_epochs and not scale_lr:
            raise ValueError(
                f"warmup_epochs={warmup_epochs} ramps the learning rate up to N x base, "
                "which only happens with scale_lr=True. Pass scale_lr=True or drop "
                "warmup_epochs."
            )
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(f"sync_batchnorm must be True or False, not {sync_batchnorm!r}.")
        if reset_states not in RESET_CHOICES:
            raise ValueError(f"reset_states={reset_states!r}: pass 'epoch' (zero stateful RNN "
                             "states at each epoch and each evaluate/predict) or None (never; "
                             "call parallel.reset_states() yourself).")
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"drop_remainder must be True or False, not {drop_remainder!r}.")
        return cls(batch, scale_lr, warmup_epochs, sync_batchnorm, reset_states,
                   drop_remainder)


def global_batch(options, batch_size, num_replicas):
    """The global batch a fit/evaluate/predict call uses for the user's batch_size."""
    if batch_size is None:
        batch_size = KERAS_DEFAULT_BATCH
    return batch_size * num_replicas if options.batch == "per_replica" else batch_size


def lr_factor(options, num_replicas):
    return float(num_replicas) if options.scale_lr else 1.0


def describe(*, backend, engine, options, template, samples=None, batch_size=None, stateful="none"):
    """The plan, as text."""
    n = engine.num_replicas
    gb = global_batch(options, batch_size, n)
    per = [gb // n + (1 if r < gb % n else 0) for r in range(n)]
    per_text = str(per[0]) if len(set(per)) == 1 else f"{min(per)}-{max(per)} (uneven split)"
    steps = f"{math.ceil(samples / gb)} ({samples} samples)" if samples else "depends on the data"
    params = sum(int(math.prod(v.shape)) * _itemsize(v.dtype) for v in template.trainable_weights)
    reduced = params * 2 * (n - 1) / n
    factor = lr_factor(options, n)
    lr = f"x{factor:g} (linear scaling rule)" if options.scale_lr else "x1 (unchanged)"
    if options.warmup_epochs:
        lr += f", warm-up from x1 over {options.warmup_epochs} epoch(s)"
    lines = [
        ("backend", backend),
        ("engine", engine.name),
        ("devices", f"{n}: {', '.join(engine.device_names)}"),
        ("batch policy", options.batch),
        ("global batch", str(gb)),
        ("per-replica batch", per_text),
        ("steps/epoch", steps),
        ("learning rate", lr),
        ("BatchNorm", engine.batchnorm_mode()),
        ("stateful RNNs", stateful),
        ("all-reduce/step", f"{_bytes(reduced)} (params {_bytes(params)} x 2(N-1)/N)"),
    ]
    width = max(len(k) for k, _ in lines)
    return "kmgpu plan\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in lines)


def _itemsize(dtype):
    import numpy as np

    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:
        return 2 if "16" in str(dtype) else 4


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024

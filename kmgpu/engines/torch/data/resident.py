"""Arrays kept on the GPU for a call (apart from ``inputs`` by role): a one-device fit,
evaluate or predict (``device_feed``, ``device_eval_feed``) and a rank's training arrays
(``on_device``) read every batch from a copy on the device, not from the host.

The copy runs beside the steps. A call's arrays cross to the GPU from pageable host
memory at a few GB/s: copied whole before the call, a large image array would hold back
the first step by many batches' worth of steps. ``DeviceArraySource`` copies them in row chunks of
about ``CHUNK_BYTES`` on a thread with its own CUDA stream, in order, and a batch waits
only for the chunks that hold its rows (a shuffled batch, for all of them): the first
step starts after the first chunk, and the rest of the copy overlaps the steps. Arrays
of one chunk or less are copied whole before the call.
"""

import contextlib
import threading

import keras
import numpy as np

from kmgpu import environment
from kmgpu.engines.torch.data.inputs import ArraySource, RankSlices, _is_array_like, is_dataset

#: rows per chunk of the copy: about this many bytes (at least one row)
CHUNK_BYTES = 32 << 20


class DeviceArraySource(ArraySource):
    """An ArraySource copied once to a device: each batch is gathered there (a slice, or
    ``index_select`` by the epoch's order, itself copied once per epoch), so a step
    has no host slicing and no blocking host-to-device copy. Same values and dtypes.
    Arrays over one chunk are copied on a thread, chunk after chunk (module docstring);
    ``take`` waits for the rows it reads.

    Args:
        source: the ArraySource.
        device: the torch device.
    """

    def __init__(self, source, device):
        import torch

        def empty(a):  # the device array (a dtype torch lacks raises here, before any copy)
            dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype
            return torch.empty(a.shape, dtype=dtype, device=device)

        self.n, self.device = source.n, device
        host = keras.tree.map_structure(lambda a: None if a is None else np.asarray(a),
                                        source.parts)
        self.parts = keras.tree.map_structure(lambda a: None if a is None else empty(a), host)
        self._order, self._on_device = None, None
        pairs = [(a, t) for a, t in zip(keras.tree.flatten(host),
                                        keras.tree.flatten(self.parts)) if a is not None]
        row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a, _ in pairs)
        rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
        self._ready, self._error = threading.Condition(), None
        if rows >= self.n:
            _copy(pairs, 0, self.n)
            self._copied = self.n
        else:
            self._copied = 0
            threading.Thread(target=self._copy_all, args=(pairs, rows), daemon=True,
                             name="kmgpu-resident-copy").start()

    def _copy_all(self, pairs, rows):
        import torch

        on_cuda = torch.device(self.device).type == "cuda"
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        try:
            with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
                for lo in range(0, self.n, rows):
                    hi = min(self.n, lo + rows)
                    _copy(pairs, lo, hi)
                    if on_cuda:
                        stream.synchronize()  # the rows are there for every stream
                    with self._ready:
                        self._copied = hi
                        self._ready.notify_all()
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread by _wait)
            with self._ready:
                self._error = e
                self._ready.notify_all()

    def _wait(self, hi):
        """Return once rows [0, hi) are on the device."""
        if self._copied >= hi:
            return
        with self._ready:
            while self._copied < hi and self._error is None:
                self._ready.wait()
        if self._copied < hi:
            raise RuntimeError("kmgpu: copying the arrays to the device failed: "
                               f"{self._error!r}") from self._error

    def copied(self):
        """Rows on the device so far (all of them once the copy is done)."""
        return self._copied

    def batch(self, s, batch_size, order):
        rows, n = super().batch(s, batch_size, order)
        if order is None:
            return rows, n
        if order is not self._order:
            import torch

            self._order, self._on_device = order, torch.as_tensor(order).to(self.device)
        return self._on_device[s * batch_size:s * batch_size + n], n

    def take(self, rows):
        if isinstance(rows, slice):
            self._wait(self.n if rows.stop is None else rows.stop)
            return keras.tree.map_structure(lambda a: None if a is None else a[rows],
                                            self.parts)
        self._wait(self.n)
        return keras.tree.map_structure(
            lambda a: None if a is None else a.index_select(0, rows), self.parts)


def _copy(pairs, lo, hi):
    """Rows [lo, hi) of each host array into its device array (a read-only or strided
    host array through a contiguous, writable copy of those rows: torch reads only)."""
    import torch

    for a, t in pairs:
        t[lo:hi].copy_(torch.from_numpy(np.require(a[lo:hi], requirements=("C", "W"))))


def on_device(source, device, fraction=0.25):
    """``source`` kept on ``device`` (a ``DeviceArraySource``) when it is an
    ArraySource on a CUDA device whose arrays take at most ``fraction`` of the free
    device memory; else ``source`` itself. ``KMGPU_TORCH_RESIDENT=0`` turns it off."""
    import torch

    device = torch.device(device)
    if (not isinstance(source, ArraySource) or device.type != "cuda"
            or not environment.enabled("KMGPU_TORCH_RESIDENT")):
        return source
    leaves = [a for a in keras.tree.flatten(source.parts) if a is not None]
    try:
        size = sum(int(np.asarray(a).nbytes) for a in leaves
                   if np.asarray(a).dtype.kind in "biuf")
        if len(leaves) != sum(np.asarray(a).dtype.kind in "biuf" for a in leaves):
            return source
        if size > fraction * torch.cuda.mem_get_info(device)[0]:
            return source
        return DeviceArraySource(source, device)
    except (RuntimeError, TypeError, ValueError):
        return source


def device_feed(kwargs, device):
    """One device's fit arguments with the arrays kept on ``device`` (``on_device``):
    ``x`` becomes a one-replica ``RankSlices`` over them, shuffled the same way.
    Unchanged when they do not fit, or with validation_split, class_weight or
    steps_per_epoch (Keras's own array path then)."""
    x = kwargs.get("x")
    if (x is None or is_dataset(x) or not _is_array_like(x) or kwargs.get("validation_split")
            or kwargs.get("class_weight") is not None or kwargs.get("steps_per_epoch")):
        return kwargs
    source = on_device(ArraySource(x, kwargs.get("y"), kwargs.get("sample_weight")), device)
    if not isinstance(source, DeviceArraySource):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in ("y", "sample_weight")}
    batch_size = out.pop("batch_size", None) or 32
    out["validation_batch_size"] = out.get("validation_batch_size") or batch_size
    out["x"] = RankSlices(source, batch_size, 0, 1, shuffle=out.get("shuffle", True))
    out["shuffle"] = False
    return out


def device_eval_feed(method, kwargs, device):
    """One device's evaluate / predict arguments with the arrays kept on ``device``
    (``on_device``): ``x`` becomes a one-replica ``RankSlices`` in order (the same rows
    and order as Keras's batches); unchanged when they do not fit or are not arrays."""
    x = kwargs.get("x")
    if x is None or is_dataset(x) or not _is_array_like(x):
        return kwargs
    parts = (x,) if method == "predict" else (x, kwargs.get("y"), kwargs.get("sample_weight"))
    source = on_device(ArraySource(*parts), device)
    if not isinstance(source, DeviceArraySource):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in ("y", "sample_weight", "batch_size")}
    out["x"] = RankSlices(source, kwargs.get("batch_size") or 32, 0, 1)
    return out


def batch_on(batch, device):
    """``batch`` (Keras's (x, y, sample_weight), any nesting) with its torch tensors on
    ``device``. A DataLoader yields its batches on the CPU: torch's own, and the one Keras
    makes for a grain dataset (keras-hub's ``fit`` makes one where TensorFlow is not
    installed). Keras's layers would copy them to the GPU inside the step, a copy from
    pageable host memory that CUDA graph capture refuses, so such a fit would run every
    step eagerly; copied before the step, its steps can be captured. Anything else is
    left as it is (arrays, None, tensors already there)."""
    import torch

    device = torch.device(device)

    def move(t):
        if torch.is_tensor(t) and t.device != device:
            return t.to(device, non_blocking=True)
        return t

    return keras.tree.map_structure(move, batch)

"""Keras callbacks that come with kmgpu.

``GPUMonitor`` is the ``watch nvidia-smi`` people run by hand next to a training
job, as a callback: each epoch it adds every GPU's mean utilisation and peak
memory to the logs (so to ``History`` and the progress line), and at the end of
training it prints one summary line. It reads NVML through ``nvidia-ml-py``
(``import pynvml``), imported only when training starts. Where there is no NVIDIA
GPU (or no NVML) it says so once and does nothing else.

``EpochTimer`` adds each epoch's wall time, throughput and peak memory to the
logs; ``kmgpu bench`` measures with it.

Both are plain ``keras.callbacks.Callback`` objects: pass them to ``fit`` of a
``ParallelModel`` or of any Keras model. With the torch engine's worker processes,
callbacks run here in the calling process, with the user's model, on the epoch
events the workers relay; they hold no open handles between fits.
"""

import os
import resource
import sys
import threading
import time

import keras

_said_no_gpu = False  # "no NVIDIA GPU" is said once per process


class NvmlUnavailable(Exception):
    """Why NVML cannot be used here, in words."""


def _nvml():
    """Import pynvml and initialise NVML; return the module or raise NvmlUnavailable."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError and friends: no driver, no library
        raise NvmlUnavailable(f"NVML did not start ({e})") from None
    return pynvml


def visible_gpu_indices(count):
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES, when it
    lists plain indices; NVML itself ignores that variable)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return list(range(count)) if visible is None else []
    ids = []
    for part in visible.split(","):
        part = part.strip()
        if not part.isdigit():
            return list(range(count))  # UUIDs or MIG names: show them all
        if int(part) < count:
            ids.append(int(part))
    return ids


def nvidia_gpus():
    """The NVIDIA GPUs NVML sees, as a list of names ([] where there are none).

    Imports nothing but pynvml, so it may run before Keras or a backend starts.
    """
    try:
        nvml = _nvml()
    except NvmlUnavailable:
        return []
    try:
        count = nvml.nvmlDeviceGetCount()
        return [_name(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    finally:
        nvml.nvmlShutdown()


def _name(nvml, handle):
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else name


class GPUMonitor(keras.callbacks.Callback):
    """Per-GPU utilisation and memory each epoch, in the logs; one summary line at the end.

    A background thread samples NVML every ``interval`` seconds while ``fit`` runs.
    Each epoch adds, for every monitored GPU ``i``:

    - ``gpu{i}_util``: mean utilisation over the epoch, in percent (NVML's "GPU busy"
      figure, as ``nvidia-smi`` shows it);
    - ``gpu{i}_mem``: peak memory in use during the epoch, in MiB (all processes).

    Args:
        gpus: NVML indices to watch; None means the GPUs in ``CUDA_VISIBLE_DEVICES``,
            or all of them.
        interval: seconds between samples (NVML updates utilisation about every
            1/6 s to 1 s, depending on the GPU).
        verbose: 1 prints the summary line at the end of training (and the
            "no NVIDIA GPU" notice); 0 prints nothing.

    After training, ``summary`` holds the summary line, ``per_gpu`` a dict per GPU and
    ``history`` the per-epoch values by log key (also where an engine runs ``fit`` in
    worker processes and this callback here).
    """

    # it reads the clock, NVML and the allocator's peak, never the weights: the torch
    # engine's callback relay need not load rank 0's state for its hooks
    _kmgpu_weight_free = True

    def __init__(self, gpus=None, interval=0.5, verbose=1):
        super().__init__()
        if interval <= 0:
            raise ValueError(f"interval={interval!r}: pass a number of seconds > 0.")
        self.gpus = None if gpus is None else [int(g) for g in gpus]
        self.interval = float(interval)
        self.verbose = verbose
        self.summary = None
        self.per_gpu = {}
        self.history = {}
        self._reset_runtime()

    def _reset_runtime(self):
        self._nvml = None
        self._handles = {}
        self._thread = None
        self._stop = None
        self._lock = threading.Lock()
        self._samples = {}
        self._history = {}

    def __getstate__(self):  # NVML handles, threads and locks stay in their process
        state = self.__dict__.copy()
        for key in ("_nvml", "_handles", "_thread", "_stop", "_lock", "_samples", "_history"):
            state.pop(key, None)
        state.pop("_model", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    @property
    def active(self):
        """True while NVML is open and GPUs are being watched."""
        return self._nvml is not None

    # -- training events ----------------------------------------------------------
    def on_train_begin(self, logs=None):
        global _said_no_gpu
        self.summary, self.per_gpu, self.history = None, {}, {}
        try:
            nvml = _nvml()
        except NvmlUnavailable as e:
            if self.verbose and not _said_no_gpu:
                print(f"GPUMonitor: no NVIDIA GPU to watch - {e}; not monitoring.",
                      file=sys.stdout, flush=True)
            _said_no_gpu = True
            return
        count = nvml.nvmlDeviceGetCount()
        wanted = self.gpus if self.gpus is not None else visible_gpu_indices(count)
        wanted = [i for i in wanted if 0 <= i < count]
        if not wanted:
            nvml.nvmlShutdown()
            if self.verbose and not _said_no_gpu:
                print(f"GPUMonitor: no NVIDIA GPU to watch (NVML sees {count}, "
                      f"asked for {self.gpus}); not monitoring.", flush=True)
            _said_no_gpu = True
            return
        self._nvml = nvml
        self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        self._history = {i: {"util": [], "mem": []} for i in wanted}
        self._names = {i: _name(nvml, h) for i, h in self._handles.items()}
        self._total = {i: nvml.nvmlDeviceGetMemoryInfo(h).total / 2**20
                       for i, h in self._handles.items()}
        self._samples = {i: [] for i in wanted}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="kmgpu-GPUMonitor",
                                        daemon=True)
        self._thread.start()

    def on_epoch_begin(self, epoch, logs=None):
        if self.active:
            self._take()  # drop what was sampled between epochs
            self._sample_once()

    def on_epoch_end(self, epoch, logs=None):
        if not self.active:
            return
        self._sample_once()
        for i, samples in self._take().items():
            util = sum(s[0] for s in samples) / len(samples)
            mem = max(s[1] for s in samples)
            self._history[i]["util"].append(util)
            self._history[i]["mem"].append(mem)
            for key, value in ((f"gpu{i}_util", round(util, 1)), (f"gpu{i}_mem", round(mem, 1))):
                self.history.setdefault(key, []).append(value)
                if logs is not None:
                    logs[key] = value

    def on_train_end(self, logs=None):
        if not self.active:
            return
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 1)
        parts = []
        for i, h in self._history.items():
            if not h["util"]:
                continue
            info = {
                "name": self._names[i],
                "util_mean": sum(h["util"]) / len(h["util"]),
                "util_max": max(h["util"]),
                "mem_peak_mib": max(h["mem"]),
                "mem_total_mib": self._total[i],
            }
            self.per_gpu[i] = info
            parts.append(
                f"gpu{i} {info['name']}: util {info['util_mean']:.0f}% mean / "
                f"{info['util_max']:.0f}% max epoch, memory peak "
                f"{info['mem_peak_mib'] / 1024:.1f}/{info['mem_total_mib'] / 1024:.1f} GiB"
            )
        epochs = max((len(h["util"]) for h in self._history.values()), default=0)
        self.summary = f"GPUMonitor ({epochs} epoch(s)): " + ("; ".join(parts) or "no samples")
        if self.verbose:
            print(self.summary, flush=True)
        self._nvml.nvmlShutdown()
        self._nvml = None

    # -- sampling -----------------------------------------------------------------
    def _sample_loop(self):
        while not self._stop.wait(self.interval):
            self._sample_once()

    def _sample_once(self):
        nvml = self._nvml
        if nvml is None:
            return
        now = []
        for i, h in self._handles.items():
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                mem = nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
            except Exception:  # a GPU fell off the bus, NVML shut down meanwhile
                continue
            now.append((i, util, mem))
        with self._lock:
            for i, util, mem in now:
                self._samples.setdefault(i, []).append((util, mem))

    def _take(self):
        with self._lock:
            taken = {i: s for i, s in self._samples.items() if s}
            self._samples = {i: [] for i in self._samples}
        return taken


def peak_memory():
    """(bytes, what) for the peak memory of this process's main device so far.

    A GPU's allocator peak where the backend reports one (device 0 of this process;
    each backend's ``runtime.peak_memory``), else the process's peak resident set size.
    """
    from kmgpu import engines

    peak = engines.runtime(keras.config.backend()).peak_memory()
    if peak is not None:
        return peak, "gpu"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss * (1 if sys.platform == "darwin" else 1024)), "rss"


def reset_peak_memory():
    """Restart the device's peak-memory counter where the backend allows it (torch, TF)."""
    from kmgpu import engines

    engines.runtime(keras.config.backend()).reset_peak_memory()


class EpochTimer(keras.callbacks.Callback):
    """Each epoch's wall time, samples/s and peak memory, in the logs and on the callback.

    Logs: ``epoch_seconds``; ``samples_per_s`` when ``samples`` is given; and the
    peak memory so far in bytes (see ``peak_memory()``): ``peak_gpu_memory`` where
    the backend reports its GPU allocator's peak, else ``peak_rss`` (the process).
    The same figures stay on the callback (``epoch_seconds``, ``peak_memory``,
    ``memory_kind``), also when an engine runs ``fit`` in worker processes and the
    callback in this one.

    Args:
        samples: samples per epoch, for ``samples_per_s``.
    """

    # it reads the clock, NVML and the allocator's peak, never the weights: the torch
    # engine's callback relay need not load rank 0's state for its hooks
    _kmgpu_weight_free = True

    def __init__(self, samples=None):
        super().__init__()
        self.samples = samples
        self.epoch_seconds = []
        self.peak_memory, self.memory_kind = 0, None
        self._start = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_model", None)
        return state

    def on_train_begin(self, logs=None):
        self.epoch_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.epoch_seconds.append(seconds)
        self.peak_memory, self.memory_kind = peak_memory()
        if logs is None:
            return
        logs["epoch_seconds"] = seconds
        if self.samples:
            logs["samples_per_s"] = self.samples / seconds
        logs["peak_gpu_memory" if self.memory_kind == "gpu" else "peak_rss"] = self.peak_memory

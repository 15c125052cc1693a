"""What the host did during each timed epoch of a bench run, to tell why two runs of the
same code differ (``plain vs plain again``).

A host-bound step (plain Keras on torch dispatches each op from Python) is as fast as the
thread that dispatches it. Per epoch this callback records that thread's CPU seconds, the
process's, the times the thread was taken off its CPU while it could run (involuntary
context switches), and the machine's steal time (a virtual machine's CPUs running another
guest). An epoch whose wall time grew with its thread's CPU seconds ran slower code or a
slower CPU; one whose wall time grew without them waited: for the GPU, for a CPU taken by
another thread or another guest. Where an engine trains in worker processes (kmgpu's torch
engine on several devices) the figures are those of the process that runs the callbacks.
"""

import resource
import time

import keras


def steal_seconds():
    """The machine's steal time so far in seconds (all CPUs; Linux ``/proc/stat``), or
    None where it cannot be read."""
    import os

    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _now():
    thread = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return {"thread_cpu_s": time.thread_time(), "process_cpu_s": time.process_time(),
            "preemptions": thread.ru_nivcsw, "steal_s": steal_seconds()}


class HostTimes(keras.callbacks.Callback):
    """Per epoch: ``thread_cpu_s``, ``process_cpu_s``, ``preemptions`` and ``steal_s``
    (lists in ``per_epoch``, one value an epoch; ``steal_s`` None where not readable)."""

    _kmgpu_weight_free = True  # reads clocks only: the torch relay need not load weights

    def __init__(self):
        super().__init__()
        self.per_epoch = {key: [] for key in _now()}
        self._start = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_model", None)
        return state

    def on_epoch_begin(self, epoch, logs=None):
        self._start = _now()

    def on_epoch_end(self, epoch, logs=None):
        end = _now()
        for key, value in end.items():
            start = self._start[key]
            self.per_epoch[key].append(
                None if value is None or start is None else round(value - start, 4))

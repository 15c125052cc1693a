"""The captured train step: kmgpu's default torch step on CUDA devices (``plan``).

Keras 3.15.1's eager torch step is mostly host work (launching kernels one by one, on a
GPU most of the step), and Keras's own meaning of ``jit_compile=True`` on torch,
``torch.compile`` of the step, runs measurably slower than eager on a GPU. On CUDA devices
kmgpu runs each replica's step as CUDA graphs unless the model was compiled with
``run_eagerly=True``; ``jit_compile=True`` also asks for it on a CPU, where it runs
eagerly. The step has three stages (``SplitStep``):

  A  forward, loss and the gradients (weighted by the replica's share of the global
     batch) written into one flat buffer per dtype, with the BatchNorm moving
     statistics to average beside them;
     one all-reduce (sum) of those buffers, eager: NCCL/gloo and kmgpu's fault
     handling stay outside any graph;
  B  the optimizer update, the averaged statistics put back, the loss tracker and
     the compiled metrics.

``CapturedStep`` runs the first steps of a batch shape eagerly (on a side stream,
the warm-up), then records A and B as two CUDA graphs on static input buffers and
replays them; any other shape (the last partial batch) runs eagerly. On a CPU (no
CUDA graphs) the very same stages run eagerly; that is what the CPU tests check
against Keras's step. If a capture fails (a host read in ``call``: ``.item()``,
Python control flow on data), the partial graph is dropped and, after a second
try, the model trains eagerly on, with one printed line saying why; every rank
still meets in the same one all-reduce per step, captured or not. A replay re-runs
the recorded device work only: Python side effects of ``call`` happen in the
warm-up and capture steps. The graphs and their memory (``graph_bytes``) live as
long as the replica (or, on one device, the ParallelModel: ``close()`` frees them).
While a step runs, Keras's ``convert_to_tensor`` makes python scalars on the device
(``keras_fixes.device_scalars``: capture refuses Keras's blocking scalar copies) and
Keras's random functions draw from the seed generators' device state
(``keras_fixes.device_random``, ``rng``), so random layers capture and draw anew
at every replay.
"""

import contextlib
import gc
import os

import keras
import torch

from kmgpu.engines import global_losses
from kmgpu.engines.torch import cuda_graphs, keras_fixes, split_step
from kmgpu.engines.torch.split_step import (  # noqa: F401 (graphs.SplitStep etc.)
    FlatBuffers, SplitStep, _map, _num_rows, _unpack)

#: eager steps of one batch signature (on a side stream) before it is captured
WARMUP_STEPS = 2
#: batch signatures captured per step object (the full batch, and one more)
MAX_GRAPHS = 2
#: captures tried (each after a warm-up) before the step stays eager
CAPTURE_TRIES = 2


def available(device):
    """Whether steps on ``device`` can be captured (CUDA graphs need a CUDA device)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


#: CUDA-graph capture that leaves torch as it found it when it fails (tests fake this name)
capture = cuda_graphs.capture


class ReplayFailed(Exception):
    """A graph's replay raised (the step then runs eagerly); ``reason`` says why."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


#: which step a compiled model trains with (``plan``)
KERAS, SPLIT, OWN = "keras", "split", "own"


def plan(model, on_gpu):
    """Which train step ``model`` gets, and why: (KERAS | SPLIT | OWN, reason).

    What ``compile()``'s flags mean on torch: ``jit_compile="auto"`` (Keras's
    default, resolved False on torch) or False: the captured step on CUDA devices,
    Keras's eager step on a CPU (nothing to capture there); ``jit_compile=True``: the
    split step everywhere (captured on CUDA, eager on a CPU); ``run_eagerly=True``:
    Keras's eager step (the way to turn the capture off). A model with its own
    ``train_step`` keeps it (kmgpu cannot split a step it did not write).
    """
    if keras_fixes.has_own_train_step(model):
        return OWN, "a model's own train_step runs as written, eagerly"
    if not getattr(model, "compiled", False) or not model.trainable_weights:
        return KERAS, "nothing to train"
    if model.run_eagerly:
        return KERAS, "compile(run_eagerly=True) asks for Keras's eager step"
    if keras_fixes.wants_captured_step(model) or on_gpu:
        return SPLIT, None
    return KERAS, ("on a CPU there is nothing to capture (compile(jit_compile=True) runs "
                   "kmgpu's split step eagerly)")


def describe(model, on_gpu, world, sync_batchnorm=False, graph_bytes=None,
             tf32=cuda_graphs.TF32_DEFAULT):
    """The train step, in words, for ``describe()`` (on a GPU with kmgpu's split step:
    the float32 matmul policy too)."""
    text = _describe(model, on_gpu, world, sync_batchnorm, graph_bytes)
    if on_gpu and plan(model, on_gpu)[0] == SPLIT:
        text += "; " + cuda_graphs.precision_words(tf32)
    return text


def _describe(model, on_gpu, world, sync_batchnorm=False, graph_bytes=None):
    kind, why = plan(model, on_gpu)
    if kind == OWN:
        return ("your model's own train_step, eager" + (" (gradients averaged in "
                                                        "optimizer.apply)" if world > 1 else "")
                + (f": {why}, not captured" if on_gpu else ""))
    if kind == KERAS:
        return ("Keras's eager step" + (" (gradients summed by DDP in backward)" if world > 1
                                        else "") + f": {why}")
    what = ("forward+backward into a flat gradient buffer, " +
            ("one all-reduce, " if world > 1 else "") +
            f"optimizer ({split_step.optimizer_words(model)})+metrics")
    if sync_batchnorm and world > 1:
        return (f"split step ({what}), eager: sync_batchnorm all-reduces inside the "
                "forward pass, which stays out of a graph")
    if not on_gpu:
        return f"split step ({what}), eager: CUDA graphs need GPUs (jit_compile=True)"
    held = (f"; its graphs hold {graph_bytes / 2**20:.0f} MiB of GPU memory until close()"
            if graph_bytes else "; the graphs' memory is freed by close()")
    return (f"captured: {what} as CUDA graphs after {WARMUP_STEPS} warm-up steps, random "
            f"layers included; other batch shapes eager; off with compile(run_eagerly=True)"
            f"{held}")


def _fill(static, batch):
    """Copy a batch into a graph's static input buffers."""
    for s, t in zip(keras.tree.flatten(static), keras.tree.flatten(batch)):
        if s is not None:
            s.copy_(t, non_blocking=True)


def _signature(batch, n_real, n_global):
    shapes = _map(lambda t: (tuple(t.shape), str(t.dtype), str(t.device)), batch)
    return repr(shapes), n_real, n_global


class _Graphs:
    """One batch signature's static inputs, graph A and graph B (or None: B eager)."""

    def __init__(self, split, static, graph_a, loss, y_pred, n_real, n_global):
        self.split, self.static = split, static
        self.graph_a, self.loss, self.y_pred = graph_a, loss, y_pred
        self.n_real, self.n_global = n_real, n_global
        self.graph_b, self.logs = None, None

    def run(self, batch, say=None):
        """One step; ``ReplayFailed`` when graph A's replay raises (nothing ran: the
        caller runs the eager step, which meets the other ranks in the same all-reduce).
        If graph B's replay raises, B runs eagerly from here on."""
        _fill(self.static, batch)
        try:
            self.graph_a.replay()
        except Exception as e:
            raise ReplayFailed(_why(e)) from e
        split = self.split
        split.exchange()  # the all-reduce (sharded: reduce-scatter), eager
        if self.graph_b is not None:
            try:
                self.graph_b.replay()
            except Exception as e:
                self.graph_b = self.logs = None
                if say is not None:
                    say("kmgpu (torch): replaying the optimizer and metrics failed, so they "
                        f"run eagerly after the captured forward/backward: {_why(e)}")
        if self.graph_b is None:
            logs = split.update(*self.static, self.loss, self.y_pred, self.n_real,
                                self.n_global)
            split.finish()  # sharded: the all-gather of the weights, eager
            return logs
        split.finish()
        # Keras may read the logs later (callbacks on another thread): its own copy
        return _map(lambda t: t.clone() if torch.is_tensor(t) else t, self.logs)


class CapturedStep:
    """A model's ``train_step`` that captures a ``SplitStep`` as CUDA graphs.

    Args:
        split: the SplitStep.
        device: the model's torch device (no capture off CUDA).
        say: ``say(text)`` prints a line (None: silent, e.g. ranks other than 0).
        refuse: why this step must not be captured (None: it may).
        capture_update: also capture stage B (else B runs eagerly after graph A); None:
            yes unless ``KMGPU_TORCH_CAPTURE_UPDATE=0`` (to measure the difference).
        tf32: the float32 matmul policy inside the step (``cuda_graphs.matmul_precision``;
            None: the process's own settings).
    """

    def __init__(self, split, device, say=print, refuse=None, capture_update=None, tf32=None):
        if capture_update is None:
            capture_update = os.environ.get("KMGPU_TORCH_CAPTURE_UPDATE", "1") != "0"
        self.split, self.device, self.say = split, torch.device(device), say
        self.reason, self.capture_update, self.tf32 = refuse, capture_update, tf32
        self.graphs, self.last, self.streak = {}, None, 0
        self.update_reason, self.failures = None, 0
        self._side = None
        self.pools = []  # the graphs' memory pools (one per captured signature)
        if refuse and say is not None:
            say(f"kmgpu (torch): the train step runs eagerly, not captured: {refuse}")

    def may_capture(self):
        return (self.reason is None and available(self.device)
                and len(self.graphs) < MAX_GRAPHS
                and not global_losses.gathered(self.split.model))  # all-gathers: eager

    def train_step(self, data):
        """Keras's ``train_step(data)``: one step, replayed, captured or eager."""
        x, y, sw = _unpack(data)
        split = self.split
        n_real, n_global = split.rows(x)
        with keras_fixes.device_scalars(), keras_fixes.device_random(), \
                cuda_graphs.matmul_precision(self.tf32), \
                keras_fixes.fused_batchnorm(self.device), keras_fixes.fast_ops(self.device), \
                keras_fixes.step_conditions(split.model):
            if split.layout():
                self.graphs.clear()  # other variables: every graph is stale
            sig = _signature((x, y, sw), n_real, n_global)
            entry = self.graphs.get(sig)
            # a signature is captured after WARMUP_STEPS eager steps in a row: the full
            # batch, never a last partial batch that comes once per epoch
            self.streak = self.streak + 1 if sig == self.last else 1
            self.last = sig
            if entry is None:
                if self.streak > WARMUP_STEPS and self.may_capture():
                    entry = self._capture(sig, (x, y, sw), n_real, n_global)
            if entry is not None:
                try:
                    return entry.run((x, y, sw), say=self.say)
                except ReplayFailed as e:  # graph A did not run: this step eagerly
                    self.graphs.clear()
                    self.failures = CAPTURE_TRIES - 1
                    self._failed(e.reason)
            return self._eager(x, y, sw, n_real, n_global)

    __call__ = train_step

    def _eager(self, x, y, sw, n_real, n_global):
        if self.device.type != "cuda" or not self.may_capture():
            return self.split.step(x, y, sw, n_real, n_global)
        # warm-up: on a side stream, as CUDA graph capture wants
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            logs = self.split.step(x, y, sw, n_real, n_global)
        main.wait_stream(self._side)
        return logs

    def _capture(self, sig, batch, n_real, n_global):
        split = self.split
        # Keras's forward pass leaves its autograd graph in a reference cycle; an
        # earlier step's graph still alive at capture makes autograd join that step's
        # stream (the legacy default stream after an eager step) into the capture,
        # which fails ("operation would make the legacy stream depend on a capturing
        # blocking stream"): collect it first (torch's own gc at capture is off now).
        gc.collect()
        try:
            static = _map(lambda t: t.detach().clone(), batch)
            graph_a, (loss, y_pred) = capture(
                lambda: split.forward_backward(*static, n_real, n_global))
            entry = _Graphs(split, static, graph_a, loss, y_pred, n_real, n_global)
        except Exception as e:  # drop everything of the partial graph, then eager
            self._failed(_why(e))
            return None
        if self.capture_update:
            try:
                entry.graph_b, entry.logs = capture(
                    lambda: split.update(*static, loss, y_pred, n_real, n_global),
                    pool=graph_a.pool())
            except Exception as e:
                entry.graph_b = entry.logs = None
                self.capture_update, self.update_reason = False, _why(e)
                _settle(self.device)
                if self.say is not None:
                    self.say("kmgpu (torch): the optimizer and metrics run eagerly after the "
                             f"captured forward/backward: {self.update_reason}")
        self.graphs[sig] = entry
        gc.collect()  # the capture's own autograd graph: later eager steps need none of it
        self.pools.append(entry.graph_a.pool())
        return entry

    @property
    def graph_bytes(self):
        """GPU memory the graphs' pools hold now (0 once closed)."""
        return pool_bytes(self.pools) if self.graphs else 0

    def close(self):
        """Drop the graphs and return their memory to the device."""
        self.graphs.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.pools = []

    def _failed(self, reason):
        """A capture failed: drop it; try once more after another warm-up, then eager."""
        self.failures += 1
        self.graphs.clear()
        self.streak = 0
        _settle(self.device)
        if self.failures < CAPTURE_TRIES:
            return
        self.reason = reason
        if self.say is not None:
            self.say("kmgpu (torch): capturing the train step failed, so this model trains "
                     f"with the eager step from here on: {reason}")


def pool_bytes(pools):
    """Bytes in the CUDA caching allocator's segments that belong to these graph pools."""
    if not pools or not torch.cuda.is_available():
        return 0
    wanted = {tuple(p) for p in pools}
    return sum(int(seg.get("total_size", 0)) for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or ()) in wanted)


_why = cuda_graphs.why


def _settle(device):
    """After a failed capture: free what referred to it and wait for the device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- the one-device path (engine.TorchLocalEngine) ------------------------------------------
@contextlib.contextmanager
def installed(model, step):
    """Within the block, ``model.fit`` runs ``step`` as its train step, and Keras
    compiles nothing (jit_compile False); afterwards the model is as it was."""
    was = model.jit_compile
    keras_fixes.set_jit_compile(model, False)
    model.train_step = step.train_step
    try:
        yield
    finally:
        model.__dict__.pop("train_step", None)
        keras_fixes.set_jit_compile(model, was)


@contextlib.contextmanager
def eager_keras(model):
    """Within the block Keras runs the model's evaluate / predict eagerly (no torch.compile)."""
    was = model.jit_compile
    keras_fixes.set_jit_compile(model, False)
    try:
        yield
    finally:
        keras_fixes.set_jit_compile(model, was)


def device_of(model):
    """The torch device ``model``'s variables live on (cpu when it has none)."""
    weights = model.weights
    return weights[0].value.device if weights else torch.device("cpu")


def local_step(model, tf32=None):
    """A CapturedStep for ``model`` on its own device (one replica)."""
    return CapturedStep(SplitStep(model), device_of(model), tf32=tf32)

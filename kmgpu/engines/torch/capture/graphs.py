"""Captured steps on torch: the one mechanism that runs the train, test and predict
steps as CUDA graphs (``CapturedSteps``), and the captured train step, kmgpu's default
torch step on CUDA devices (``plan``); the test and predict steps are ``eval_steps``'s.

Keras 3.15.1's eager torch step is mostly host work (launching kernels one by one, on a
GPU most of the step), and Keras's own meaning of ``jit_compile=True`` on torch,
``torch.compile`` of the step, runs measurably slower than eager on a GPU. On CUDA devices
kmgpu runs each replica's step as CUDA graphs unless the model was compiled with
``run_eagerly=True``; ``jit_compile=True`` also asks for it on a CPU, where it runs
eagerly. The train step has three stages (``split_step.SplitStep``):

  A  forward, loss and the gradients (weighted by the replica's share of the global
     batch) written into one flat buffer per dtype, with the BatchNorm moving
     statistics to average beside them;
     one all-reduce (sum) of those buffers, eager: NCCL/gloo and kmgpu's fault
     handling stay outside any graph (sharded: ``TrainGraphs``);
  B  the optimizer update, the averaged statistics put back, the loss tracker and
     the compiled metrics.

``CapturedSteps`` does the same for every kind of step ("train", "test", "predict"):
the first ``WARMUP_STEPS`` steps of a batch signature run eagerly (on the device's side
stream, ``cuda_graphs.aside``), then the step is recorded as CUDA graphs on static input
buffers and replayed; any other shape (the last partial batch) runs eagerly. The train
step records A and B as two graphs (``CapturedStep``). On a CPU (no CUDA graphs) the very
same steps run eagerly; that is what the CPU tests check against Keras's steps. If a
capture fails (a host read in ``call``: ``.item()``, Python control flow on data), the
partial graph is dropped with torch left as it was (``cuda_graphs.capture``) and, after a
second try, or at once when a replay fails, that kind of step runs eagerly on, with one
printed line saying why; every rank still meets in the same one all-reduce per step,
captured or not. A replay re-runs the recorded device work only: Python side effects of
``call`` happen in the warm-up and capture steps. Graphs read the memory of the weights
they were recorded with: when the weights move into new flat buffers or the train step
remakes its gradient buffers (either moves ``flat_layout.generation``), every graph is
dropped, to be recorded anew. The graphs and their memory (``graph_bytes``) live as long as the
step object (on one device, the ParallelModel: ``close()`` frees them). A batch that comes
on the host (a DataLoader's) is copied to the device before the step
(``resident.batch_on``). While a step runs
(``step_context``), Keras's ``convert_to_tensor`` makes python scalars on the device
(``capture_fixes.device_scalars``: capture refuses Keras's blocking scalar copies) and
Keras's random functions draw from the seed generators' device state
(``capture_fixes.device_random``, ``rng``), so random layers capture and draw anew at
every replay.
"""

import contextlib
import gc

import keras
import torch

from kmgpu import environment
from kmgpu.engines import global_losses
from kmgpu.engines.torch import capture_fixes, cond_fixes, fast_fixes, precision, step_fixes
from kmgpu.engines.torch.capture import cuda_graphs
from kmgpu.engines.torch.data import resident
from kmgpu.engines.torch.optim import flat_layout
from kmgpu.engines.torch.steps import split_step
from kmgpu.engines.torch.steps.split_step import SplitStep

#: eager steps of one batch signature (on a side stream) before it is captured
WARMUP_STEPS = 2
#: batch signatures captured per kind of step (the full batch, and one more)
MAX_GRAPHS = 2
#: captures tried (each after a warm-up) before a kind of step stays eager
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


def choose_step(model, on_gpu):
    """Which train step ``model`` gets, and why: (KERAS | SPLIT | OWN, reason).

    What ``compile()``'s flags mean on torch: ``jit_compile="auto"`` (Keras's
    default, resolved False on torch) or False: the captured step on CUDA devices,
    Keras's eager step on a CPU (nothing to capture there); ``jit_compile=True``: the
    split step everywhere (captured on CUDA, eager on a CPU); ``run_eagerly=True``:
    Keras's eager step (the way to turn the capture off). A model with its own
    ``train_step`` keeps it (kmgpu cannot split a step it did not write).
    """
    if step_fixes.has_own_train_step(model):
        return OWN, "a model's own train_step runs as written, eagerly"
    if not getattr(model, "compiled", False) or not model.trainable_weights:
        return KERAS, "nothing to train"
    if model.run_eagerly:
        return KERAS, "compile(run_eagerly=True) asks for Keras's eager step"
    if capture_fixes.wants_captured_step(model) or on_gpu:
        return SPLIT, None
    return KERAS, ("on a CPU there is nothing to capture (compile(jit_compile=True) runs "
                   "kmgpu's split step eagerly)")


def describe(model, on_gpu, world, sync_batchnorm=False, graph_bytes=None,
             tf32=precision.TF32_DEFAULT):
    """The train step, in words, for ``describe()`` (on a GPU with kmgpu's split step:
    the float32 matmul policy too)."""
    text = _describe(model, on_gpu, world, sync_batchnorm, graph_bytes)
    if on_gpu and choose_step(model, on_gpu)[0] == SPLIT:
        text += "; " + precision.words(tf32)
    return text


def _describe(model, on_gpu, world, sync_batchnorm=False, graph_bytes=None):
    kind, why = choose_step(model, on_gpu)
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


# -- the mechanism ----------------------------------------------------------------------
@contextlib.contextmanager
def step_context(model, device, tf32):
    """What every captured step runs within, warm-up, capture and replay alike: Keras's
    scalars and random draws on the device (capture refuses host copies), the float32
    matmul policy, the fused BatchNorm and fast ops on CUDA, conditions on the device."""
    with capture_fixes.device_scalars(), capture_fixes.device_random(), \
            precision.matmul_precision(tf32), fast_fixes.fused_batchnorm(device), \
            fast_fixes.fast_ops(device), cond_fixes.step_conditions(model):
        yield


def _map(fn, structure):
    """``keras.tree.map_structure`` that leaves None alone (a leaf on torch)."""
    return keras.tree.map_structure(lambda t: None if t is None else fn(t), structure)


def _signature(batch, n_real, n_global):
    shapes = _map(lambda t: (tuple(t.shape), str(t.dtype), str(t.device)), batch)
    return repr(shapes), n_real, n_global


def _copied(out):
    """Keras may read a step's outputs later (callbacks on another thread), after the
    next replay overwrote the graph's: its own copy."""
    return _map(lambda t: t.clone() if torch.is_tensor(t) else t, out)


class Replay:
    """One captured step: its static input buffers, its graph, the tensors it writes."""

    def __init__(self, graph, static, out):
        self.graph, self.static, self.out = graph, static, out

    def replay(self, batch):
        """Copy ``batch`` into the static inputs and replay the graph; ``ReplayFailed``
        when the replay raises."""
        for s, t in zip(keras.tree.flatten(self.static), keras.tree.flatten(batch)):
            if s is not None:
                s.copy_(t, non_blocking=True)
        try:
            self.graph.replay()
        except Exception as e:
            raise ReplayFailed(cuda_graphs.why(e)) from e

    def run(self, batch, say=None):
        self.replay(batch)
        return _copied(self.out)


class CapturedSteps:
    """The one captured-step mechanism: for each kind of step ("train", "test",
    "predict") the warm-up, capture, replay, retry and give-up, the graphs' memory
    pools, dropping stale graphs, and ``close()``.

    A subclass says what its steps are: ``_function(kind, rows)`` the eager step, a
    function of (x, y, sample_weight); ``_record(kind, static, rows)`` the captured one,
    a ``Replay`` (its ``capture`` calls are made there); ``_rows(kind, x)`` the (real,
    global) rows of a batch, part of its signature; ``_prepare()`` (re)makes, before
    every step, the buffers the step's graphs read.

    Args:
        model: the model whose steps these are.
        device: its torch device (no capture off CUDA).
        say: ``say(text)`` prints a line (None: silent, e.g. ranks other than 0).
        tf32: the float32 matmul policy inside the steps (``precision.matmul_precision``;
            None: the process's own settings).
        refused: {kind: why that kind must not be captured}.
    """

    #: the line printed when a kind of step stays eager ({doing}: capturing or replaying)
    GAVE_UP = ("kmgpu (torch): {doing} the {kind} step failed, so it runs eagerly from "
               "here on: {reason}")

    def __init__(self, model, device, say=print, tf32=None, refused=None):
        self.model, self.device, self.say, self.tf32 = model, torch.device(device), say, tf32
        self.refused = dict(refused or {})  # kind -> why it runs eagerly
        self.graphs = {}  # (kind, signature) -> Replay
        self.pools = []  # the graphs' memory pools (one per captured signature)
        self.last, self.streak, self.failures = {}, {}, {}
        self._generation = flat_layout.generation

    def step(self, kind, data):
        """One step of ``kind`` on Keras's ``data``: replayed, captured or eager."""
        batch = resident.batch_on(keras.utils.unpack_x_y_sample_weight(data), self.device)
        with step_context(self.model, self.device, self.tf32):
            self._drop_stale()
            rows = self._rows(kind, batch[0])
            key = (kind, _signature(batch, *rows))
            # a signature is captured after WARMUP_STEPS eager steps in a row: the full
            # batch, never a last partial batch that comes once per epoch
            self.streak[kind] = self.streak.get(kind, 0) + 1 if key == self.last.get(kind) else 1
            self.last[kind] = key
            entry = self.graphs.get(key)
            if entry is None and self.streak[kind] > WARMUP_STEPS and self.may_capture(kind):
                entry = self._capture(kind, key, batch, rows)
            if entry is not None:
                try:
                    return entry.run(batch, say=self.say)
                except ReplayFailed as e:  # nothing of the step ran: it runs eagerly
                    self._failed(kind, "replaying", e.reason)
            fn = self._function(kind, rows)
            if self.device.type != "cuda" or not self.may_capture(kind):
                return fn(*batch)
            return cuda_graphs.aside(self.device, lambda: fn(*batch))  # a warm-up step

    def may_capture(self, kind):
        return (kind not in self.refused and available(self.device)
                and sum(k[0] == kind for k in self.graphs) < MAX_GRAPHS
                and not global_losses.gathered(self.model))  # all-gathers: eager

    def _rows(self, kind, x):
        return 0, 0

    def _prepare(self):
        """Before every step: (re)make what the step's graphs read (nothing here)."""

    def _drop_stale(self):
        """Drop every graph when memory it reads may have moved: a flat buffer was made
        since the last step (``flat_layout.generation`` counts them, any model's: the
        weights moved into one, or ``_prepare`` remade the step's own buffers)."""
        self._prepare()
        if self._generation != flat_layout.generation:
            self._generation = flat_layout.generation
            self.graphs.clear()

    def _capture(self, kind, key, batch, rows):
        # Keras's forward pass leaves its autograd graph in a reference cycle; an
        # earlier step's graph still alive at capture makes autograd join that step's
        # stream (the legacy default stream after an eager step) into the capture,
        # which fails ("operation would make the legacy stream depend on a capturing
        # blocking stream"): collect it first (torch's own gc at capture is off now).
        gc.collect()
        try:
            static = _map(lambda t: t.detach().clone(), batch)
            entry = self._record(kind, static, rows)
        except Exception as e:  # drop everything of the partial graph, then eager
            self._failed(kind, "capturing", cuda_graphs.why(e))
            return None
        self.graphs[key] = entry
        self.pools.append(entry.graph.pool())
        return entry

    def _failed(self, kind, doing, reason):
        """A capture or a replay of ``kind`` failed: drop that kind's graphs and wait for
        the device; a capture is tried again after another warm-up (``CAPTURE_TRIES`` in
        all), a replay is not; then that kind runs eagerly, and one line says why."""
        tries = self.failures.get(kind, 0) + 1
        self.failures[kind] = CAPTURE_TRIES if doing == "replaying" else tries
        for key in [k for k in self.graphs if k[0] == kind]:
            del self.graphs[key]
        self.streak[kind] = 0
        cuda_graphs.recover(self.device)
        if self.failures[kind] < CAPTURE_TRIES:
            return
        self.refused[kind] = reason
        if self.say is not None:
            self.say(self.GAVE_UP.format(doing=doing, kind=kind, reason=reason))

    @property
    def graph_bytes(self):
        """GPU memory the graphs' pools hold now (0 once closed)."""
        return pool_bytes(self.pools) if self.graphs else 0

    def close(self):
        """Drop the graphs and return their memory to the device."""
        self.graphs.clear()
        cuda_graphs.release(self.device)
        self.pools = []


def pool_bytes(pools):
    """Bytes in the CUDA caching allocator's segments that belong to these graph pools."""
    if not pools or not torch.cuda.is_available():
        return 0
    wanted = {tuple(p) for p in pools}
    return sum(int(seg.get("total_size", 0)) for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or ()) in wanted)


# -- the train step ---------------------------------------------------------------------
class TrainGraphs(Replay):
    """One batch signature's train step: graph A (``graph``), then the exchange, eager,
    then graph B (None: B runs eagerly).

    The exchange (``split_step.SplitStep.exchange``) is the gradient's all-reduce, the
    BatchNorm statistics beside it; with shard="optimizer" or "gradients" the
    gradient's reduce-scatter and the statistics' all-reduce; with shard="weights" only
    the statistics' all-reduce (none without BatchNorm): each layer's gradient was
    reduce-scattered inside graph A, in the backward pass. Where a sharded gradient is
    all-reduced whole (clipnorm, global_clipnorm, a loss scale), that all-reduce is here
    for every shard value."""

    def __init__(self, split, static, graph_a, loss, y_pred, n_real, n_global):
        super().__init__(graph_a, static, (loss, y_pred))
        self.split, self.loss, self.y_pred = split, loss, y_pred
        self.n_real, self.n_global = n_real, n_global
        self.graph_b, self.logs = None, None
        #: the gradient buffers graph A writes (ZeRO-2 makes them inside the capture:
        #: one set per graph, in its memory pool); None: the step's own, always the same
        self.buffers = None

    def run(self, batch, say=None):
        """One step; ``ReplayFailed`` when graph A's replay raises (nothing ran: the
        caller runs the eager step, which meets the other ranks in the same collectives).
        If graph B's replay raises, B runs eagerly from here on."""
        self.replay(batch)
        split = self.split
        if self.buffers is not None:
            split.use(self.buffers)
        split.exchange()  # eager: the collectives left between A and B (see the class)
        if self.graph_b is not None:
            try:
                self.graph_b.replay()
            except Exception as e:
                self.graph_b = self.logs = None
                if say is not None:
                    say("kmgpu (torch): replaying the optimizer and metrics failed, so they "
                        f"run eagerly after the captured forward/backward: {cuda_graphs.why(e)}")
        if self.graph_b is None:
            logs = split.update(*self.static, self.loss, self.y_pred, self.n_real,
                                self.n_global)
            split.finish()  # eager: shard="optimizer"/"gradients" all-gathers the weights
            return logs
        split.finish()
        return _copied(self.logs)


class CapturedStep(CapturedSteps):
    """A model's ``train_step`` that captures a ``SplitStep`` as CUDA graphs.

    Args:
        split: the SplitStep.
        device: the model's torch device (no capture off CUDA).
        say: ``say(text)`` prints a line (None: silent, e.g. ranks other than 0).
        refuse: why this step must not be captured (None: it may).
        capture_update: also capture stage B (else B runs eagerly after graph A); None:
            yes unless ``KMGPU_TORCH_CAPTURE_UPDATE=0`` (to measure the difference).
        tf32: the float32 matmul policy inside the step (``precision.matmul_precision``;
            None: the process's own settings).
    """

    GAVE_UP = ("kmgpu (torch): capturing the train step failed, so this model trains "
               "with the eager step from here on: {reason}")

    def __init__(self, split, device, say=print, refuse=None, capture_update=None, tf32=None):
        if capture_update is None:
            capture_update = environment.enabled("KMGPU_TORCH_CAPTURE_UPDATE")
        super().__init__(split.model, device, say=say, tf32=tf32,
                         refused={"train": refuse} if refuse else None)
        self.split, self.capture_update, self.update_reason = split, capture_update, None
        if refuse and say is not None:
            say(f"kmgpu (torch): the train step runs eagerly, not captured: {refuse}")

    @property
    def reason(self):
        """Why the train step runs eagerly (None: it may be captured)."""
        return self.refused.get("train")

    def train_step(self, data):
        """Keras's ``train_step(data)``: one step, replayed, captured or eager."""
        return self.step("train", data)

    def _rows(self, kind, x):
        return self.split.rows(x)

    def _prepare(self):
        self.split.layout()  # other variables: new gradient buffers, every graph stale

    def _function(self, kind, rows):
        split = self.split
        return lambda x, y, sw: split.step(x, y, sw, *rows)

    def _record(self, kind, static, rows):
        split = self.split
        n_real, n_global = rows
        # the gradient buffers are outputs of graph A too: with ZeRO-2 the step makes
        # them inside the capture (``SplitStep.begin``), so they are this graph's
        graph_a, ((loss, y_pred), _) = capture(
            lambda: (split.forward_backward(*static, n_real, n_global), split.flats))
        entry = TrainGraphs(split, static, graph_a, loss, y_pred, n_real, n_global)
        if split.transient:
            entry.buffers = split.current
        if self.capture_update:
            try:
                entry.graph_b, entry.logs = capture(
                    lambda: split.update(*static, loss, y_pred, n_real, n_global),
                    pool=graph_a.pool())
            except Exception as e:
                entry.graph_b = entry.logs = None
                self.capture_update, self.update_reason = False, cuda_graphs.why(e)
                cuda_graphs.recover(self.device)
                if self.say is not None:
                    self.say("kmgpu (torch): the optimizer and metrics run eagerly after the "
                             f"captured forward/backward: {self.update_reason}")
        gc.collect()  # the capture's own autograd graph: later eager steps need none of it
        return entry


# -- on one device (engine.TorchLocalEngine) --------------------------------------------
@contextlib.contextmanager
def installed(model, steps, kinds=("train",)):
    """Within the block, Keras's fit / evaluate / predict (fit's validation included)
    run ``steps``'s steps of ``kinds`` ("train", "test", "predict") as the model's own,
    and Keras compiles nothing (jit_compile False; its step functions are made anew);
    afterwards the model is as it was."""
    was = model.jit_compile
    capture_fixes.set_jit_compile(model, False)
    for kind in kinds:
        setattr(model, f"{kind}_step", getattr(steps, f"{kind}_step"))
    try:
        yield
    finally:
        for kind in kinds:
            model.__dict__.pop(f"{kind}_step", None)
        capture_fixes.set_jit_compile(model, was)


def eager_keras(model):
    """Within the block Keras runs the model's own steps eagerly (no torch.compile)."""
    return installed(model, None, kinds=())


def device_of(model):
    """The torch device ``model``'s variables live on (cpu when it has none)."""
    weights = model.weights
    return weights[0].value.device if weights else torch.device("cpu")


def local_step(model, tf32=None):
    """A CapturedStep for ``model`` on its own device (one replica)."""
    return CapturedStep(SplitStep(model), device_of(model), tf32=tf32)

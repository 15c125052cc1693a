"""The captured test and predict steps: ``evaluate``, ``predict`` and fit's validation.

Keras 3.15.1's torch ``test_step`` / ``predict_step`` are eager and mostly host work,
as its train step is (``graphs``). On one CUDA device kmgpu runs Keras's own steps
(the same code: forward with ``training=False``, ``_compute_loss``, the loss tracker,
``compute_metrics``; predict: the forward pass) as CUDA graphs: the first
``WARMUP_STEPS`` batches of a shape eagerly on a side stream, then one capture on
static input buffers, replayed for every later batch of that shape; any other shape
(the last partial batch) eager. Rows, order and numbers are Keras's. A capture or a
replay that fails leaves torch as it was (``cuda_graphs.capture``) and the step eager
from there on, with one printed line. On a CPU the steps are Keras's own (not installed).

On N ranks (``on_rank``) each rank captures its own test step (``strategy``'s: its
rows' loss weighed by its share of the global batch, the real rows of the batch part
of the graph's signature, so a last partial batch or a stand-in row is another
signature) and Keras's predict step likewise; the steps hold no collective (the
metrics are summed over ranks when Keras reads them, outside the step), so a rank
that falls back to eager never leaves the others waiting.
"""

import contextlib

import torch

from kmgpu.engines import global_losses
from kmgpu.engines.torch import cuda_graphs, flat_layout, graphs, keras_fixes

#: describe()'s words for these steps (on CUDA devices, not with run_eagerly=True)
WORDS = ("; evaluate, predict and fit's validation: Keras's test and predict steps captured "
         "likewise (other batch shapes eager)")


class CapturedEval:
    """``test_step`` and ``predict_step`` for ``model`` on its CUDA device.

    Args:
        model: the compiled (or, for predict, built) model.
        device: its torch device.
        say: ``say(text)`` prints a line.
        tf32: the float32 matmul policy inside the steps (``cuda_graphs.matmul_precision``).
        test: ``test(x, y, sw)``, the test step to run (None: Keras's, as written here).
        rows: ``rows()`` is (real rows, global rows) of the current test batch, part of
            its signature (a rank's ``test`` weighs by them); None: no such part.
    """

    def __init__(self, model, device, say=print, tf32=None, test=None, rows=None):
        self.model, self.device, self.say, self.tf32 = model, torch.device(device), say, tf32
        self._test, self._rows = test, rows
        self.graphs, self.last, self.streak, self.reason = {}, {}, {}, {}
        self.failures = {}
        self.pools = []
        self._side = None
        self._moved = flat_layout.generation

    def test_step(self, data):
        return self._run("test", data)

    def predict_step(self, data):
        return self._run("predict", data)

    def _fn(self, kind):
        model = self.model

        def forward(x):
            return model(x, training=False) if model._call_has_training_arg else model(x)

        def test(x, y, sw):  # Keras's TorchTrainer.test_step
            y_pred = forward(x)
            loss = keras_fixes.compute_loss(model, x, y, y_pred, sw, training=False)
            model._loss_tracker.update_state(loss, sample_weight=graphs._num_rows(x))
            return model.compute_metrics(x, y, y_pred, sample_weight=sw)

        def predict(x, y, sw):
            return forward(x)

        if kind == "test":
            return self._test or test
        return predict

    def _run(self, kind, data):
        x, y, sw = graphs._unpack(data)
        batch = (x, y, sw)
        with keras_fixes.device_scalars(), keras_fixes.device_random(), \
                cuda_graphs.matmul_precision(self.tf32), \
                keras_fixes.fused_batchnorm(self.device), keras_fixes.fast_ops(self.device), \
                keras_fixes.step_conditions(self.model):
            if self._moved != flat_layout.generation:  # the weights moved: graphs stale
                self.graphs.clear()
                self._moved = flat_layout.generation
            rows = self._rows() if kind == "test" and self._rows is not None else (0, 0)
            sig = (kind, graphs._signature(batch, *rows))
            self.streak[kind] = self.streak.get(kind, 0) + 1 if sig == self.last.get(kind) else 1
            self.last[kind] = sig
            entry = self.graphs.get(sig)
            if (entry is None and self.streak[kind] > graphs.WARMUP_STEPS
                    and self._may_capture(kind)):
                entry = self._capture(kind, sig, batch)
            if entry is not None:
                try:
                    return entry.run(batch)
                except graphs.ReplayFailed as e:
                    self.graphs.pop(sig, None)
                    self._give_up(kind, e.reason, "replaying")
            return self._eager(kind, batch)

    def _may_capture(self, kind):
        return (kind not in self.reason and graphs.available(self.device)
                and sum(k[0] == kind for k in self.graphs) < graphs.MAX_GRAPHS
                and not global_losses.gathered(self.model))  # all-gathers: eager

    def _eager(self, kind, batch):
        fn = self._fn(kind)
        if self.device.type != "cuda" or not self._may_capture(kind):
            return fn(*batch)
        if self._side is None:  # warm-up: on a side stream, as capture wants
            self._side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            out = fn(*batch)
        main.wait_stream(self._side)
        return out

    def _capture(self, kind, sig, batch):
        fn = self._fn(kind)
        graphs.gc.collect()
        static = graphs._map(lambda t: t.detach().clone(), batch)
        try:
            graph, out = graphs.capture(lambda: fn(*static))
        except Exception as e:
            graphs._settle(self.device)
            self.failures[kind] = self.failures.get(kind, 0) + 1
            self.streak[kind] = 0
            if self.failures[kind] >= graphs.CAPTURE_TRIES:
                self._give_up(kind, cuda_graphs.why(e), "capturing")
            return None
        entry = _Replay(graph, static, out)
        self.graphs[sig] = entry
        self.pools.append(graph.pool())
        return entry

    def _give_up(self, kind, reason, doing):
        self.reason[kind] = reason
        if self.say is not None:
            self.say(f"kmgpu (torch): {doing} the {kind} step failed, so it runs eagerly "
                     f"from here on: {reason}")

    @property
    def graph_bytes(self):
        return graphs.pool_bytes(self.pools) if self.graphs else 0

    def close(self):
        self.graphs.clear()
        self.pools = []


class _Replay:
    """One captured test or predict step: static inputs, the graph, its outputs."""

    def __init__(self, graph, static, out):
        self.graph, self.static, self.out = graph, static, out

    def run(self, batch):
        graphs._fill(self.static, batch)
        try:
            self.graph.replay()
        except Exception as e:
            raise graphs.ReplayFailed(cuda_graphs.why(e)) from e
        return graphs._map(lambda t: t.clone() if torch.is_tensor(t) else t, self.out)


def rank_kinds(replica, device):
    """The steps a rank captures (``on_rank``): on a CUDA device, or with
    ``compile(jit_compile=True)`` (then eagerly on a CPU, as the split train step), not
    with ``run_eagerly=True``. Read before the rank sets ``jit_compile`` False."""
    if getattr(replica, "run_eagerly", False) or not (
            graphs.available(device) or keras_fixes.wants_captured_step(replica)):
        return set()
    return wants(replica)


def on_rank(strategy, replica, kinds):
    """Install captured test / predict steps (``kinds``, from ``rank_kinds``) on a
    rank's replica; its test step is the rank's own (``replica.test_step`` as
    ``strategy.prepare`` set it).

    Returns:
        the ``CapturedEval`` (None: none installed).
    """
    if not kinds:
        return None
    rank_test = replica.test_step

    def rows():
        test = strategy.test
        return test.current if test is not None else (0, 0)

    steps = CapturedEval(replica, strategy.device, say=print if strategy.rank == 0 else None,
                         tf32=strategy.tf32, test=lambda x, y, sw: rank_test((x, y, sw)),
                         rows=rows)
    from kmgpu.engines import keras_fixes as common

    if "test" in kinds and common.loss_kind(replica) == "weights":
        # "mean_with_sample_weight": the rank's loss all-reduces the sample weights
        # inside the step; collectives stay out of graphs, so this step stays eager
        steps.reason["test"] = "the loss sums sample weights over ranks in the step"
    for kind in kinds:
        setattr(replica, f"{kind}_step", getattr(steps, f"{kind}_step"))
    return steps


def wants(model):
    """Which of Keras's steps ``model`` runs as written (its own test_step or
    predict_step are kept): the set of kinds kmgpu may capture."""
    kinds = set()
    if not keras_fixes.has_own_test_step(model) and getattr(model, "compiled", False):
        kinds.add("test")
    if not keras_fixes.has_own_predict_step(model):
        kinds.add("predict")
    return kinds


@contextlib.contextmanager
def installed(model, steps, kinds):
    """Within the block ``model.evaluate`` / ``predict`` (and fit's validation) run
    ``steps``'s test and predict steps (those in ``kinds``); afterwards as it was."""
    for kind in kinds:
        setattr(model, f"{kind}_step", getattr(steps, f"{kind}_step"))
    model.test_function = model.predict_function = None
    try:
        yield
    finally:
        for kind in kinds:
            model.__dict__.pop(f"{kind}_step", None)
        model.test_function = model.predict_function = None

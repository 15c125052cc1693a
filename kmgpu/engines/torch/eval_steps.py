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
"""

import contextlib

import torch

from kmgpu.engines.torch import cuda_graphs, flat_optim, graphs, keras_fixes


class CapturedEval:
    """``test_step`` and ``predict_step`` for ``model`` on its CUDA device.

    Args:
        model: the compiled (or, for predict, built) model.
        device: its torch device.
        say: ``say(text)`` prints a line.
        tf32: the float32 matmul policy inside the steps (``cuda_graphs.matmul_precision``).
    """

    def __init__(self, model, device, say=print, tf32=None):
        self.model, self.device, self.say, self.tf32 = model, torch.device(device), say, tf32
        self.graphs, self.last, self.streak, self.reason = {}, {}, {}, {}
        self.failures = {}
        self.pools = []
        self._side = None
        self._moved = flat_optim.generation

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

        return test if kind == "test" else predict

    def _run(self, kind, data):
        x, y, sw = graphs._unpack(data)
        batch = (x, y, sw)
        with keras_fixes.device_scalars(), keras_fixes.device_random(), \
                cuda_graphs.matmul_precision(self.tf32), \
                keras_fixes.fused_batchnorm(self.device):
            if self._moved != flat_optim.generation:  # the weights moved: graphs stale
                self.graphs.clear()
                self._moved = flat_optim.generation
            sig = (kind, graphs._signature(batch, 0, 0))
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
                and sum(k[0] == kind for k in self.graphs) < graphs.MAX_GRAPHS)

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

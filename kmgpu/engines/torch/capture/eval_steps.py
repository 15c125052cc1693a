"""The captured test and predict steps: ``evaluate``, ``predict`` and fit's validation.

Keras 3.15.1's torch ``test_step`` / ``predict_step`` are eager and mostly host work,
as its train step is (``graphs``). On one CUDA device kmgpu runs Keras's own steps
(the same code: forward with ``training=False``, ``_compute_loss``, the loss tracker,
``compute_metrics``; predict: the forward pass) as CUDA graphs, by the mechanism the
train step uses (``graphs.CapturedSteps``: warm-up on a side stream, one capture per
batch shape on static input buffers, replays; any other shape, such as the last partial
batch, eager; a failed capture tried again once, then the step eager from there on with
one printed line; a step that runs out of GPU memory while these graphs hold theirs drops
them, and the test and predict steps run eagerly from there on, with one printed line).
Rows, order and numbers are Keras's. On a CPU the steps are Keras's own (not installed).

On N ranks (``capture_on_rank``) each rank captures its own test step (``strategy``'s: its
rows' loss weighed by its share of the global batch, the real rows of the batch part
of the graph's signature, so a last partial batch or a stand-in row is another
signature) and Keras's predict step likewise; the steps hold no collective (the
metrics are summed over ranks when Keras reads them, outside the step), so a rank
that falls back to eager never leaves the others waiting.
"""

from kmgpu.engines.torch import capture_fixes, step_fixes
from kmgpu.engines.torch.capture import graphs
from kmgpu.engines.torch.data import inputs

#: describe()'s words for these steps (on CUDA devices, not with run_eagerly=True)
WORDS = ("; evaluate, predict and fit's validation: Keras's test and predict steps captured "
         "likewise (other batch shapes eager)")


class CapturedEval(graphs.CapturedSteps):
    """``test_step`` and ``predict_step`` for ``model`` on its CUDA device, captured by
    the one mechanism (``graphs.CapturedSteps``).

    Args:
        model: the compiled (or, for predict, built) model.
        device: its torch device.
        say: ``say(text)`` prints a line.
        tf32: the float32 matmul policy inside the steps (``precision.matmul_precision``).
        test: ``test(x, y, sw)``, the test step to run (None: Keras's, as written here).
        rows: ``rows()`` is (real rows, global rows) of the current test batch, part of
            its signature (a rank's ``test`` weighs by them); None: no such part.
        refused: {kind: why that kind must not be captured}.
    """

    #: the line printed when a step ran out of memory beside the graphs
    NO_ROOM = ("kmgpu (torch): the {kind} step ran out of GPU memory beside the captured "
               "steps' graphs, so the {kinds} steps run eagerly from here on (their graphs "
               "dropped)")

    def __init__(self, model, device, say=print, tf32=None, test=None, rows=None,
                 refused=None):
        super().__init__(model, device, say=say, tf32=tf32, refused=refused)
        self._test, self._test_rows = test, rows

    def test_step(self, batch):
        return self._step("test", batch)

    def predict_step(self, batch):
        return self._step("predict", batch)

    def _step(self, kind, batch):
        """``step``; where it runs out of device memory while these graphs hold theirs
        (say a test graph beside the train step's graphs on a full GPU, then predict's
        warm-up step), the graphs give way: dropped, their pools back to the device, and
        every kind they were for eager from here on, this step again among them. The
        train step's graphs are the ones that pay; a test or predict step changes state
        only at its end, so nothing of the failed one is kept."""
        import torch

        try:
            return self.step(kind, batch)
        except torch.OutOfMemoryError:
            if not self.graphs:
                raise  # nothing of ours to free: the error is the model's, as in Keras
        kinds = sorted({k[0] for k in self.graphs} | {kind})
        self.close()
        for k in kinds:
            self.refused[k] = "out of GPU memory beside the captured steps' graphs"
        if self.say is not None:
            self.say(self.NO_ROOM.format(kind=kind, kinds=" and ".join(kinds)))
        return self.step(kind, batch)

    def _rows(self, kind, x):
        if kind == "test" and self._test_rows is not None:
            return self._test_rows()
        return 0, 0

    def _function(self, kind, rows):
        model = self.model

        def forward(x):
            return model(x, training=False) if model._call_has_training_arg else model(x)

        def test(x, y, sw):  # Keras's TorchTrainer.test_step
            y_pred = forward(x)
            loss = step_fixes.compute_loss(model, x, y, y_pred, sw, training=False)
            model._loss_tracker.update_state(loss, sample_weight=inputs.num_rows(x))
            return model.compute_metrics(x, y, y_pred, sample_weight=sw)

        def predict(x, y, sw):
            return forward(x)

        if kind == "test":
            return self._test or test
        return predict

    def _record(self, kind, static, rows):
        fn = self._function(kind, rows)
        graph, out = graphs.capture(lambda: fn(*static))
        return graphs.Replay(graph, static, out)


def rank_kinds(replica, device):
    """The steps a rank captures (``capture_on_rank``): on a CUDA device, or with
    ``compile(jit_compile=True)`` (then eagerly on a CPU, as the split train step), not
    with ``run_eagerly=True``. Read before the rank sets ``jit_compile`` False."""
    if getattr(replica, "run_eagerly", False) or not (
            graphs.available(device) or capture_fixes.wants_captured_step(replica)):
        return set()
    return capturable(replica)


def capture_on_rank(strategy, replica, kinds):
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

    from kmgpu.engines import loss_fixes as common

    refused = {}
    if "test" in kinds and common.loss_kind(replica) == "weights":
        # "mean_with_sample_weight": the rank's loss all-reduces the sample weights
        # inside the step; collectives stay out of graphs, so this step stays eager
        refused["test"] = "the loss sums sample weights over ranks in the step"
    steps = CapturedEval(replica, strategy.device, say=print if strategy.rank == 0 else None,
                         tf32=strategy.config.tf32, test=lambda x, y, sw: rank_test((x, y, sw)),
                         rows=rows, refused=refused)
    for kind in kinds:
        setattr(replica, f"{kind}_step", getattr(steps, f"{kind}_step"))
    return steps


def capturable(model):
    """Which of Keras's steps ``model`` runs as written (its own test_step or
    predict_step are kept): the set of kinds kmgpu may capture."""
    kinds = set()
    if not step_fixes.has_own_test_step(model) and getattr(model, "compiled", False):
        kinds.add("test")
    if not step_fixes.has_own_predict_step(model):
        kinds.add("predict")
    return kinds


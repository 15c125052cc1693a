"""The user's callbacks run once, on the driver, from events rank 0 relays.

Both ends of one protocol:

- rank side, ``SyncCallback``: the one callback every rank runs. At each hook the
  user's callbacks implement, rank 0 sends an ``Event`` (hook, index, logs,
  params) through ``relay`` and gets a ``Reply``; it broadcasts the reply, and
  every rank applies it at the same point (stop, learning rate, abort, reload).
- driver side, ``CallbackDriver``: runs the user's callbacks with the user's own
  model, in the process that called ``fit`` (the pool's driver, or rank 0 under
  torchrun), and answers each Event.

Only the hooks the user's callbacks implement cost a collective.
"""

import keras
import torch
import torch.distributed as dist

from kmgpu.engines import lr
from kmgpu.engines.torch import step_fixes
from kmgpu.engines.torch.launch.messages import Event, HistoryRecord, Reply

TRAIN_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
               "on_train_batch_begin", "on_train_batch_end")
TEST_HOOKS = ("on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end")
PREDICT_HOOKS = ("on_predict_begin", "on_predict_end", "on_predict_batch_begin",
                 "on_predict_batch_end")
#: the batch hooks whose logs are the metrics so far (predict's are outputs)
BATCH_END_LOGS = ("on_train_batch_end", "on_test_batch_end")
_ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}


def implemented_hooks(callbacks):
    """The hooks the user's callbacks implement (Keras's own ``is_default`` test).

    Returns:
        A set of hook names (``on_batch_*`` aliases as ``on_train_batch_*``).
    """
    out = set()
    for cb in callbacks or []:
        for hook in TRAIN_HOOKS + TEST_HOOKS + PREDICT_HOOKS + tuple(_ALIASES):
            method = getattr(cb, hook, None)
            if method is not None and not step_fixes.is_default(method):
                out.add(_ALIASES.get(hook, hook))
    return out


class Abort(Exception):
    """A user callback raised (on the driver): every rank leaves the call at the same
    point, so the pool stays usable."""


def plain_logs(logs):
    """Logs as plain Python numbers and NumPy arrays (picklable, device-free)."""
    if not logs:
        return logs
    return keras.tree.map_structure(
        lambda v: keras.ops.convert_to_numpy(v) if hasattr(v, "shape") and v.shape else v,
        step_fixes.pythonify_logs(logs),
    )


def record(history):
    """A History's content, to send to other ranks (``HistoryRecord``)."""
    return HistoryRecord(history.history, history.params, history.epoch)


def history_from(template, rec):
    """A ``keras.callbacks.History`` on ``template`` holding a HistoryRecord's content."""
    history = keras.callbacks.History()
    history.set_model(template)
    history.history, history.params, history.epoch = rec.history, rec.params, rec.epoch
    template.history = history
    return history


# -- rank side ------------------------------------------------------------------------
class SyncCallback(keras.callbacks.Callback):
    """The one callback every rank runs: the user's callbacks run elsewhere, once.

    ``snapshot`` (on rank 0, or on every rank where each writes its own pieces of a
    sharded state) saves the replica's state at every epoch end and at the end of
    training, before the hook is relayed, so the user's model holds the current
    weights when its callbacks look at it.

    Args:
        rank: this rank.
        device: the rank's torch device (for the reply's broadcast).
        relayed: the hooks to relay (the same on every rank).
        relay: on rank 0, ``relay(Event) -> Reply``.
        snapshot: ``snapshot(model, epoch)`` (epoch -1: end of training), on the ranks
            that save (None on the others).
        reload: ``reload(model)`` on every rank when the reply says the driver's
            callbacks changed the model's state (it loads and broadcasts it).
        batch_logs: ``batch_logs(logs)`` on every rank: a step's logs as the metrics
            summed over ranks (the model's ``_get_metrics_result_or_logs``); a relayed
            batch-end hook gets them (in place, so the progress bar shows them too).
        checkpoint: ``checkpoint(model, request)`` on every rank for each request of
            the reply's ``checkpoints`` (``launch.checkpoint_io``).
    """

    def __init__(self, rank, device, relayed=(), relay=None, snapshot=None, reload=None,
                 batch_logs=None, checkpoint=None):
        super().__init__()
        self.rank, self.device = rank, device
        self.relayed, self.relay, self.snapshot = set(relayed), relay, snapshot
        self.reload, self.batch_logs, self.checkpoint = reload, batch_logs, checkpoint
        self.epoch, self.saved_epoch = None, None
        hooks = set(self.relayed)
        if snapshot is not None:
            hooks |= {"on_epoch_begin", "on_epoch_end", "on_train_end"}
        for hook in hooks:
            setattr(self, hook, self._bind(hook))

    def _bind(self, hook):
        def call(*args, **kwargs):
            self._event(hook, *args, **kwargs)

        return call

    def _lr(self):
        opt = getattr(self.model, "optimizer", None)
        lr = getattr(opt, "_learning_rate", None)
        return lr if isinstance(lr, keras.Variable) else None

    def _event(self, hook, *args, **kwargs):
        indexed = "batch" in hook or "epoch" in hook
        index = args[0] if indexed and args else None
        rest = args[1:] if indexed else args
        logs = rest[0] if rest else kwargs.get("logs")
        if hook == "on_epoch_begin":
            self.epoch = index
        if self.snapshot is not None:
            if hook == "on_test_begin" and self.epoch is not None:
                # fit's validation: the driver's callbacks see this epoch's weights, as
                # with plain Keras (the driver loads them before relaying the hook)
                self.snapshot(self.model, self.epoch)
                self.saved_epoch = self.epoch
            elif hook == "on_epoch_end" and self.saved_epoch != index:
                self.snapshot(self.model, index)
            elif hook == "on_train_end":
                self.snapshot(self.model, -1)
        if hook not in self.relayed:
            return
        if (self.batch_logs is not None and hook in BATCH_END_LOGS
                and isinstance(logs, dict)):
            # the step returned this rank's running means: one device's are the sums
            # over ranks (a collective on every rank, as the epoch's logs)
            logs.update(plain_logs(self.batch_logs(logs)))
        # stop, has lr, lr, abort, reload the state, initial epoch (-1: None), checkpoints
        values = [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0]
        requests = []
        if self.rank == 0:
            reply = self.relay(Event(hook, index, plain_logs(logs), dict(self.params or {})))
            values[0] = float(bool(reply.stop))
            if reply.lr is not None:
                values[1], values[2] = 1.0, float(reply.lr)
            values[3] = float(bool(reply.abort))
            values[4] = float(bool(reply.reload))
            if reply.initial_epoch is not None:
                values[5] = float(reply.initial_epoch)
            if isinstance(logs, dict) and isinstance(reply.logs, dict):
                logs.update(reply.logs)  # what the callbacks added, for the progress bar
            requests = list(reply.checkpoints)
            values[6] = float(len(requests))
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(t, 0)
        stop, has_lr, lr_value, abort, reload, initial_epoch, n_requests = t.tolist()
        if abort:
            raise Abort(hook)
        if n_requests:  # where to save or restore from: to every rank
            box = [requests]
            dist.broadcast_object_list(box, 0, device=self.device)
            for request in box[0]:
                self.checkpoint(self.model, request)
        if hook == "on_train_begin":
            # what the user's callbacks set on their model (BackupAndRestore: the
            # restored weights and optimizer state, and the epoch to resume from)
            self.model._initial_epoch = int(initial_epoch) if initial_epoch >= 0 else None
            if reload and self.reload is not None:
                self.reload(self.model)
        if hook in TRAIN_HOOKS:
            self.model.stop_training = bool(stop)
        lr = self._lr()
        if has_lr and lr is not None:
            lr.assign(lr_value)


# -- driver side ----------------------------------------------------------------------
def _weight_free(callback):
    """Callbacks known to read only logs and the learning rate, never the weights."""
    cbs = keras.callbacks
    if isinstance(callback, cbs.EarlyStopping):
        return not callback.restore_best_weights
    if isinstance(callback, (cbs.History, cbs.ProgbarLogger, cbs.CSVLogger,
                             cbs.LearningRateScheduler, cbs.ReduceLROnPlateau,
                             cbs.TerminateOnNaN, cbs.RemoteMonitor)):
        return True
    if _declared_weight_free(callback):
        return True
    return type(callback).__module__ == lr.__name__  # kmgpu's learning-rate scaling


def _declared_weight_free(callback):
    """A callback whose class says it never reads the weights (``_kmgpu_weight_free =
    True``: kmgpu's EpochTimer and GPUMonitor read the clock, NVML and the allocator's
    peak); a subclass stays weight-free only while every hook it implements comes from
    the declaring class's module (one that overrides a hook may read the weights there).

    Without this, timing a fit with them would make the driver load rank 0's whole state
    (weights and optimizer state) at every epoch end, and rank 0 snapshot it for that:
    for a large model with Adam, a measurable share of each epoch on a GPU."""
    owner = next((cls for cls in type(callback).__mro__ if "_kmgpu_weight_free" in vars(cls)),
                 None)
    if owner is None or vars(owner)["_kmgpu_weight_free"] is not True:
        return False
    for hook in TRAIN_HOOKS + TEST_HOOKS + PREDICT_HOOKS + tuple(_ALIASES):
        method = getattr(callback, hook, None)
        if method is None or step_fixes.is_default(method):
            continue
        if getattr(getattr(method, "__func__", None), "__module__", None) != owner.__module__:
            return False
    return True


class CallbackDriver:
    """Runs the user's callbacks once, with the user's own model, as rank 0 relays hooks.

    Called as ``driver(event) -> Reply``. The callbacks get one logs dict in turn, as
    in Keras's CallbackList; a fit's ``History`` comes last, so it records what they
    added (a learning rate, say), and the reply carries the logs back so rank 0's
    progress bar shows them too. The reply also carries whether to stop and the
    learning rate, or ``abort`` once a callback has raised: the exception is kept in
    ``error`` and raised by the engine after every rank has left the call, so the
    worker pool stays usable -- a KeyboardInterrupt as well: the workers are waiting
    for this reply, so they stop at this hook and the model keeps what plain Keras
    keeps (the steps done). Before ``on_train_end``,
    and before ``on_epoch_end`` unless every callback is known to leave the weights
    alone (``_weight_free``), it loads rank 0's latest state into the model, so a
    checkpoint or early-stopping callback sees current weights.

    Args:
        callbacks: the user's callbacks (None: none, e.g. on a rank other than 0).
        template: the user's model.
        method: "fit", "evaluate" or "predict".
        load_state: ``load_state()`` puts rank 0's latest state in ``template``.
        push_state: ``push_state()`` sends ``template``'s state to the ranks.
    """

    def __init__(self, callbacks, template, method, load_state, push_state=None):
        self.template, self.load_state, self.push_state = template, load_state, push_state
        self.error, self.final_loaded, self._params = None, False, None
        callbacks = list(callbacks or [])
        hooks = implemented_hooks(callbacks)
        family = {"fit": TRAIN_HOOKS, "evaluate": TEST_HOOKS,
                  "predict": PREDICT_HOOKS}.get(method, ())  # *_on_batch: no callbacks
        if method == "fit":  # fit's validation runs the test hooks too
            family = family + TEST_HOOKS
            hooks |= {"on_train_begin", "on_epoch_end"}  # the History lives here
        hooks &= set(family)
        # A begin hook and its end hook travel together (Keras's CallbackList counts them).
        for prefix, hooks_of in (("on_train", TRAIN_HOOKS), ("on_test", TEST_HOOKS),
                                 ("on_predict", PREDICT_HOOKS)):
            if hooks & set(hooks_of):
                hooks |= {prefix + "_begin", prefix + "_end"}
        self.hooks = hooks
        # Rank 0 saves a snapshot and this side loads it at every epoch end only
        # when a callback here may look at the weights.
        # ... and before fit's validation, when a callback here may look at the weights
        # during it (TensorBoard's evaluation_*_vs_iterations reads the iterations at
        # on_test_end): plain Keras's model holds the epoch's weights by then
        self.validation_weights = method == "fit" and any(
            not _weight_free(cb) and implemented_hooks([cb]) & set(TEST_HOOKS)
            for cb in callbacks)
        self.needs_weights = self.validation_weights or any(
            not _weight_free(cb) and "on_epoch_end" in implemented_hooks([cb])
            for cb in callbacks)
        # ... and sends the model's state back to the ranks after on_train_begin when a
        # callback may have set it there (BackupAndRestore restores weights + epoch).
        self.may_set_weights = any(
            not _weight_free(cb) and "on_train_begin" in implemented_hooks([cb])
            for cb in callbacks)
        # ... and, where a callback may read or set the state at all, the optimizer's
        # slots travel with the weights (``launch.held_slots``: else they stay in the ranks)
        self.reads_state = any(not _weight_free(cb) for cb in callbacks)
        # ShardedCheckpoint: the ranks save and restore the state, as the callbacks ask
        self.checkpointers = [cb for cb in callbacks
                              if getattr(type(cb), "_kmgpu_sharded_checkpoint", False)]
        self.callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=(method == "fit"), model=template)
        self.history = self.callbacks._history

    def __call__(self, event):
        if self.error is not None:
            return Reply(abort=True)
        hook, index, params = event.hook, event.index, event.params
        logs = dict(event.logs) if isinstance(event.logs, dict) else event.logs
        try:
            if params and params != self._params:
                self.callbacks.set_params(params)
                self._params = params
            if (hook == "on_train_end" or (hook == "on_epoch_end" and self.needs_weights)
                    or (hook == "on_test_begin" and self.validation_weights)):
                self.load_state()
                self.final_loaded = hook == "on_train_end"
            if hook == "on_train_begin":
                self.template.stop_training = False
            for cb in self.checkpointers:
                cb.requests = []
            try:
                for callback in self.callbacks.callbacks:
                    fn = getattr(callback, hook)
                    fn(logs) if index is None else fn(index, logs)
            finally:
                requests = tuple(r for cb in self.checkpointers for r in cb.requests)
                for cb in self.checkpointers:
                    cb.requests = None  # outside this relay it saves its model itself
        except BaseException as e:
            # KeyboardInterrupt too (raised by a callback, or Ctrl-C while one runs): the
            # workers wait for this reply, so they leave the call together at this hook
            # and keep the state plain Keras keeps; the engine raises it, the pool lives
            self.error = e
            return Reply(abort=True)
        initial_epoch, reload = None, False
        if hook == "on_train_begin":
            # Keras's fit starts at model._initial_epoch when a callback set it
            initial_epoch = getattr(self.template, "_initial_epoch", None)
            if self.may_set_weights and self.push_state is not None:
                self.push_state()
                reload = True
        lr = getattr(getattr(self.template, "optimizer", None), "_learning_rate", None)
        return Reply(stop=bool(getattr(self.template, "stop_training", False)),
                     lr=float(lr.numpy()) if isinstance(lr, keras.Variable) else None,
                     reload=reload, initial_epoch=initial_epoch, logs=logs,
                     checkpoints=requests)

"""What travels between the driver (the process that called ``fit``) and the torch ranks.

Typed records instead of dicts and tuples. A worker of kmgpu's pool receives them
on its pipe (pickled by ``multiprocessing``); under torchrun the same records are
passed in-process. Plain data only: nothing here imports Keras or torch.

Driver -> worker: ``Port`` (rendezvous), ``Call``, ``WeightsQuery``, ``Reply``, ``Exit``.
Worker -> driver: ``Port`` (rank 0), ``Ready``, ``Event``, ``Done``, ``Failed``, and
under shard="weights" the state over the pipe (``Want``, ``Pieces``: ``launch.state_pipe``).
What the driver notes about a worker itself: ``Died``, ``TimedOut``.
What a call returns per rank: ``RankResult`` holding ``None`` (fit), evaluate's value,
``Predictions`` or ``Aborted``.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

#: written by a worker to its output pipe at the end of every call
END_MARK = b"\x1e\x1fkmgpu-call-end\x1f\x1e"


# -- what describes a model and its state ---------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A model as config, for a worker to re-create it (``replicas.FromSpec``).

    ``objects`` is the pickled {"custom": {name: class or function} the config needs,
    "compile": the compile recipe or None}, or None when they could not be pickled:
    forked workers then inherit them (``transport.INHERITED``).
    """

    config: dict
    build_config: Optional[dict]
    objects: Optional[bytes]
    #: replication.carried(template): adapted layers, optimizer settings
    carried: tuple = (None, None)


@dataclass(frozen=True)
class StateLayout:
    """How a model's state is laid out as a flat list of arrays (``replicas.state_of``).

    The list is the model's weights, then ``n_optimizer`` optimizer state variables,
    then the learning rate when ``has_lr`` (a rate held in a variable).
    """

    arrays: tuple  # ((shape, dtype str), ...), one per array
    n_weights: int
    n_optimizer: int
    has_lr: bool


# -- driver -> worker -----------------------------------------------------------------
@dataclass(frozen=True)
class Port:
    """The rendezvous port: rank 0 -> driver, then driver -> every other rank."""

    port: int


@dataclass(frozen=True)
class Call:
    """One ``fit`` / ``evaluate`` / ``predict`` / ``*_on_batch`` call, the same for every
    rank.

    Args:
        method: "fit", "evaluate", "predict", "train_on_batch", "test_on_batch" or
            "predict_on_batch".
        config: the run's ``kmgpu.engines.base.Config``, which every rank's strategy is
            made from (``DDPStrategy(device, config)``), in a pool worker as under torchrun.
        key: what the rank's cached replica must match (``replicas.replica_key`` and
            ``config``: a replica is made with one config).
        kwargs: Keras's keyword arguments, global batch sizes, without callbacks
            (the pool replaces arrays by ``transport.Leaf`` files).
        rng: the driver's host random states (``shuffle.state``): every rank starts
            the call from them, so it shuffles as plain Keras would.
        lr_scale: (factor, warmup_steps) for a LearningRateSchedule.
        hooks: the hooks the user's callbacks implement (relayed to the driver).
        epoch_weights: rank 0 saves its state at every epoch end (a callback reads it).
        rnn_states: the template's stateful RNN states, all B rows each.
        reset_states: zero the states now and at every epoch start.
        model: the model for a worker that has no replica for ``key`` yet.
        state_path: the pool's ``transport.StateFile``; slot 0 holds the state in.
        layout: the arrays in that file.
        state_in: False when the ranks' replicas hold the template's state already
            (nothing written to slot 0: the replicas stay as they are).
        slots_back: under shard="weights", the snapshots carry the optimizer's slots
            too (the user's callbacks may read or set the state); else they stay in the
            ranks until the driver asks for them (``SlotsQuery``).
        piped: the state travels over the pipes, each rank's pieces straight between
            your model and the rank (``launch.state_pipe``), not through the state file's
            slots (shard="weights": no whole copy of the state anywhere but your model).
        absent: with ``piped``, the layout's arrays the driver does not send (a new
            optimizer's zero slots): the ranks make them at zero.
    """

    method: str
    config: Any
    key: Any
    kwargs: dict
    rng: Any
    lr_scale: tuple
    hooks: tuple
    epoch_weights: bool
    rnn_states: list
    reset_states: bool
    model: Optional[ModelSpec] = None
    state_path: Optional[str] = None
    layout: Optional[StateLayout] = None
    state_in: bool = True
    slots_back: bool = True
    piped: bool = False
    absent: tuple = ()


@dataclass(frozen=True)
class SlotsQuery:
    """Every rank writes its pieces (or rank 0 the whole values) of the optimizer
    variables at ``indices`` of ``layout`` into ``slot`` of the state file at
    ``state_path``, rank 0 marks it complete; the driver copies them into the user's
    optimizer (``launch.held_slots``)."""

    state_path: Optional[str]  # None: over the pipe (``Call.piped``)
    layout: StateLayout
    indices: tuple
    slot: int = 1


@dataclass(frozen=True)
class WeightsQuery:
    """For tests: every rank answers with its replica's weights (``what`` "weights"), or
    the bytes its train step's tensors hold (``what`` "held": ``SplitStep.held_bytes``)."""

    what: str = "weights"


@dataclass(frozen=True)
class Exit:
    """Leave the process group and end the process."""


# -- callbacks: rank 0 -> driver and back ---------------------------------------------
@dataclass(frozen=True)
class Event:
    """A callback hook on rank 0, for the user's callbacks on the driver (``relay``)."""

    hook: str
    index: Optional[int]  # the batch or epoch; None for begin/end hooks
    logs: Any
    params: dict


@dataclass(frozen=True)
class Reply:
    """The driver's answer to an Event; every rank applies it at the same point.

    Args:
        stop: a callback set ``model.stop_training``.
        lr: the learning rate the callbacks left (None: not a variable).
        abort: a callback raised; every rank leaves the call.
        reload: the callbacks changed the model's state (BackupAndRestore): load it.
        initial_epoch: the epoch fit resumes from, when a callback set one.
        logs: the logs as the callbacks left them (for rank 0's progress bar).
        checkpoints: what ``kmgpu.checkpoints.ShardedCheckpoint`` callbacks ask the ranks
            to do at this hook: ("save", folder, extra) / ("restore", folder, manifest).
    """

    stop: bool = False
    lr: Optional[float] = None
    abort: bool = False
    reload: bool = False
    initial_epoch: Optional[int] = None
    logs: Any = None
    checkpoints: tuple = ()


# -- worker -> driver -----------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The worker joined the process group."""

    pid: int


@dataclass(frozen=True)
class Done:
    """A call (or query) ended; ``value`` is a RankResult (or a weights list)."""

    value: Any


@dataclass(frozen=True)
class Failed:
    """The worker raised; it exits after sending this.

    Args:
        exception: the pickled exception, or None when it does not pickle.
        traceback: the formatted traceback.
        collective: it failed inside a collective (likely another rank's fault).
    """

    exception: Optional[bytes]
    traceback: str
    collective: bool


@dataclass(frozen=True)
class Died:
    """Noted by the driver: the worker ended without answering."""

    exitcode: Optional[int]


@dataclass(frozen=True)
class TimedOut:
    """Noted by the driver: the worker did not answer in time."""


# -- the state over the pipe: worker -> driver (``launch.state_pipe``) --------------
@dataclass(frozen=True)
class Want:
    """A rank asks for these elements of your model's state; the driver sends each as
    raw bytes, in order, on the same pipe.

    Args:
        ranges: ((array index in the call's layout, start, stop), ...): the flat
            elements ``[start, stop)`` of that array.
    """

    ranges: tuple


@dataclass(frozen=True)
class Pieces:
    """A rank's part of a snapshot follows as raw bytes, one message per range, into
    your model's variables; the driver answers True once it has them.

    Args:
        ranges: as ``Want``'s.
        seq: the snapshot's number (the same on every rank that writes it).
        epoch: the state is the one at this epoch's end; -1: the end of training,
            -2: where a fit stopped.
        writers: how many ranks send their part of this snapshot.
        missing: the layout's arrays this snapshot leaves out (the optimizer's slots
            the ranks keep).
    """

    ranges: tuple
    seq: int
    epoch: int
    writers: int
    missing: tuple = ()


# -- what a call returns --------------------------------------------------------------
@dataclass(frozen=True)
class Aborted:
    """A user callback raised, or a batch was refused (``error``,
    ``batch_checks.BatchRefused``); every rank left the call at the same point."""

    error: Any = None


@dataclass(frozen=True)
class Predictions:
    """One rank's predictions and where their rows go in the output."""

    positions: Any  # int array
    outputs: Any    # Keras's predict output structure, this rank's real rows only


@dataclass
class RankResult:
    """One rank's answer to a Call.

    Args:
        result: fit: None; evaluate: Keras's return value (summed over ranks);
            predict: Predictions; or Aborted.
        states: this rank's stateful RNN state rows (empty list: none).
        rows: the ``*_on_batch`` methods: the real rows of the batch this rank ran.
        touched: a call that does not train changed this rank's replica state (a
            custom step assigned a variable): the template's goes in next time.
        rng: rank 0's host random states at the end (``shuffle.state``), for the driver.
    """

    result: Any = None
    states: list = field(default_factory=list)
    rows: Optional[int] = None
    touched: bool = False
    rng: Any = None


@dataclass(frozen=True)
class HistoryRecord:
    """A ``keras.callbacks.History``'s content, to send to other ranks."""

    history: dict
    params: dict
    epoch: list

"""The ways to train a workload that ``kmgpu bench`` compares, all measured alike.

    plain      ``model.fit`` on one device: the reference for speed-up, kmgpu / plain fit, parity.
    replay     plain ``model.fit`` once more: how much two identical runs differ (timing
               noise, and the parity floor where GPU kernels are not deterministic). In a
               process that ran the plain fit of the workload, the replay fits that same
               model again (its weights and optimizer state put back to where they started,
               its compiled step kept): the same code, without a second build and compile.
    kmgpu      ``kmgpu.parallelize(model, gpus=n, batch=policy)`` then ``fit``; with
               ``KMGPU_BENCH_JIT_COMPILE=1`` compiled with ``jit_compile=True`` (on torch:
               kmgpu's captured CUDA-graph step, opt-in), recorded as "jit_compile".
    peer       the framework's own data-parallel way, written by hand:
               tensorflow  ``tf.distribute.MirroredStrategy`` (model built and compiled
                           in the scope, as the Keras/TF guides do), then ``fit``;
               jax         ``keras.distribution.DataParallel`` scope, then ``fit``;
               torch       the DistributedDataParallel loop of the keras.io guide
                           "Multi-GPU distributed training with PyTorch" (``ddp.py``).
    reference  torch only: torchvision's ResNet-50 in a plain PyTorch loop, channels_last,
               one GPU (``ddp.py``): what the same network costs without Keras.

Batch policies: "global" (the workload's batch is the global batch at every N) and
"per_replica" (each of the N devices takes the workload's batch; global N x batch; the
learning rate is scaled by N, as kmgpu does by default, for kmgpu and the peer alike).

Every run starts from the same initial weights (the workload's seed), sees the same data
in the same order (``shuffle=False``) and records each epoch's wall time, peak memory, the
last loss and the final weights.

Every Keras-based run is timed after its own warm-up, so its timed epochs hold no
compile: at least ``WARMUP_STEPS`` untimed steps (whole epochs of the run's own data)
through the same ``fit`` (it compiles the step, fills the caches, lets autotuning and the
GPU's clocks settle), and more untimed epochs, one at a time, until the last two are
within ``STEADY`` of each other and they have run for ``WARMUP_MIN_S`` after that first
call (at most ``WARMUP_EPOCHS_MAX`` epochs once they have, and ``WARMUP_MAX_S``); then the
model's
weights and optimizer state back to where they were (the compiled step stays), then the
timed epochs. The warm-up's wall time is the run's ``warmup_s`` (the compile included);
samples/s is the median of the timed epochs. Beside each timed epoch the run keeps what
the host did (``hosttimes.py``: the dispatching thread's CPU seconds, its preemptions,
the machine's steal time), the evidence where plain fit and plain fit again differ. The
replay of a model that plain fit has already compiled and warmed in this process needs
no settling time: its warm-up ends once two epochs agree (``WARMUP_MIN_S`` does not
apply).

Plain fit and kmgpu then time ``evaluate`` and ``predict`` on the first
``INFER_BATCHES`` batches of the epoch's data, the same for every runner (``predict``
copies the whole output to the host: for a language model's logits over a whole epoch
that can take longer than the training): one untimed call (it compiles), then the
median of ``INFER_REPEATS`` timed calls (``--quick``: the first call, compile included).
The replay (plain fit again) times no evaluate or predict: it is there for the noise of
the training figures.
"""

import time

import numpy as np

from kmgpu.bench.common import collect, global_batch, has_gpu

WARMUP_STEPS = 10
STEADY = 0.10  # the warm-up ends when its last two epochs are this close
# ... and once its epochs after the first call (the compile) have run this long: a model
# whose epochs take a fraction of a second is otherwise timed while the GPU's clocks and
# autotuning still settle (its first timed epochs slower than its last)
WARMUP_MIN_S = 2.0
WARMUP_EPOCHS_MAX = 4  # the warm-up's epochs at most, the first call's included, once ...
WARMUP_MAX_S = 10.0  # ... WARMUP_MIN_S is reached; and its seconds after the first call
INFER_BATCHES = 1
INFER_REPEATS = 3


def run(runner, workload, n, policy="global"):
    """Train ``workload`` on ``n`` devices with ``runner`` and batch ``policy``.

    Returns:
        dict(epoch_seconds=[...], peak_memory=bytes, memory_kind="nvml"|"gpu"|"rss",
        allocator_peak=bytes (where known), gpu_util=% (with NVML), loss=float,
        host={"thread_cpu_s": [...], ...} (hosttimes.py, per timed epoch),
        weights=[np.ndarray, ...], samples_per_epoch, global_batch, and for the plain
        run the model's FLOPs per sample).
    """
    import keras

    backend = keras.config.backend()
    if policy not in ("global", "per_replica"):
        raise ValueError(f"unknown batch policy {policy!r}")
    if runner == "reference":
        from kmgpu.bench import ddp

        return ddp.reference(workload, n, cuda=has_gpu())
    if runner in ("plain", "replay"):  # replay: plain fit again, for the noise floor
        if n != 1 or policy != "global":
            raise ValueError("plain model.fit runs on one device at the global batch")
        if runner == "replay" and workload in _PLAIN:
            model, init = _PLAIN.pop(workload)
            _restart(model, init)
            return _plain(workload, model, backend, flops=False, compiled=True,
                          already_warm=True)
        model = workload.build()  # outside any scope: the same weights in every process
        _PLAIN.clear()  # one workload's model waits for its replay, no other
        _PLAIN[workload] = (model, model.get_weights())
        return _plain(workload, model, backend, flops=runner == "plain")
    model = workload.build()
    init = model.get_weights()
    if runner == "kmgpu":
        return _kmgpu(workload, n, model, policy)
    if runner == "peer":
        if backend == "torch":
            from kmgpu.bench import ddp

            return ddp.peer(workload, n, init, policy, cuda=has_gpu())
        return {"tensorflow": _mirrored, "jax": _data_parallel}[backend](
            workload, n, init, policy)
    raise ValueError(f"unknown runner {runner!r}")


#: the last plain fit's model and initial weights, per workload: its replay fits it again
_PLAIN = {}


def _restart(model, weights):
    """``model`` back to ``weights`` with its optimizer's slots and step count at zero (the
    learning rate kept), its compiled step kept."""
    import keras

    model.set_weights(weights)
    for v in model.optimizer.variables:
        if not v.path.endswith("learning_rate"):
            v.assign(np.zeros(v.shape, dtype=keras.backend.standardize_dtype(v.dtype)))


def compile_args(workload, lr_scale=1):
    args = workload.compile_args()
    if lr_scale != 1:
        import keras

        args["optimizer"] = keras.optimizers.Adam(learning_rate=1e-3 * lr_scale)
    return args


# -- Keras fit based ---------------------------------------------------------------
def _warm_up(fit, model, x, y, batch_size, steps, quick=False, minimum_s=None):
    """Untimed epochs of ``x``, ``y`` through ``fit`` (``steps`` per epoch): at least
    ``WARMUP_STEPS`` steps in one call, then one epoch at a time until the last two
    epochs are within ``STEADY`` of each other and the epochs after that first call have
    run ``minimum_s`` (default ``WARMUP_MIN_S``; ``quick``: one epoch, a code-path check
    on a CPU measures nothing); then ``model``'s weights and optimizer state as they were
    (Adam's slots and step count start at zero; the learning rate is kept). Returns
    {"warmup_s": its seconds, "warmup_calls_s": each ``fit`` call's wall seconds,
    "warmup_epochs_s": each epoch's}: a call's seconds beyond its epochs' are the call's
    own cost (a compile, the set-up of ``fit``)."""
    from kmgpu.callbacks import EpochTimer

    weights = model.get_weights()
    start = time.perf_counter()
    timer = EpochTimer()
    first = 1 if quick else max(2, -(-WARMUP_STEPS // max(steps, 1)))
    fit(x, y, batch_size=batch_size, epochs=first, shuffle=False, verbose=0,
        callbacks=[timer])
    seconds = list(timer.epoch_seconds)
    calls = [time.perf_counter() - start]
    while not quick and not warm(seconds, sum(calls[1:]), minimum_s):
        timer = EpochTimer()
        call = time.perf_counter()
        fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
            callbacks=[timer])
        calls.append(time.perf_counter() - call)
        seconds += timer.epoch_seconds or [float("inf")]
    took = time.perf_counter() - start
    _restart(model, weights)
    return {"warmup_s": took, "warmup_calls_s": calls, "warmup_epochs_s": seconds}


def warm(seconds, settled, minimum=None):
    """Whether a warm-up is done whose epochs took ``seconds`` and whose calls after the
    first took ``settled`` seconds of wall time (at least ``minimum``, default
    ``WARMUP_MIN_S``)."""
    if settled >= WARMUP_MAX_S:
        return True
    if settled < (WARMUP_MIN_S if minimum is None else minimum):
        return False
    return steady(seconds) or len(seconds) >= WARMUP_EPOCHS_MAX


def steady(seconds):
    """Whether the last two epoch times are within ``STEADY`` of each other."""
    if len(seconds) < 2:
        return False
    a, b = seconds[-2:]
    return abs(a - b) <= STEADY * min(a, b)


def _fit(fit, x, y, batch_size, workload, model=None, already_warm=False):
    """Warm-up (``already_warm``: the model was compiled and warmed in this process),
    then the timed epochs."""
    from kmgpu.bench.hosttimes import HostTimes
    from kmgpu.callbacks import EpochTimer, GPUMonitor, reset_peak_memory

    steps = workload.steps or -(-len(x) // batch_size)
    warmup = (_warm_up(fit, model, x, y, batch_size, steps, workload.quick,
                       minimum_s=0.0 if already_warm else None)
              if model is not None else None)
    reset_peak_memory()
    timer, monitor = EpochTimer(len(x)), GPUMonitor(interval=0.2, verbose=0)
    host = HostTimes()
    history = fit(x, y, batch_size=batch_size, epochs=workload.epochs, shuffle=False,
                  verbose=0, callbacks=[timer, monitor, host])
    # Read the callbacks themselves: an engine that trains in worker processes runs
    # them here but need not copy what they add to the logs into its History.
    result = collect(timer.epoch_seconds, timer.peak_memory, timer.memory_kind, monitor,
                     float(history.history["loss"][-1]))
    result["samples_per_epoch"] = len(x)
    result["host"] = host.per_epoch
    if warmup is not None:
        result.update(warmup)
    return result


def _infer(model, x, y, batch_size, warm=True):
    """Seconds of ``evaluate`` and of ``predict`` on the first ``INFER_BATCHES`` batches
    of ``x``: the median of ``INFER_REPEATS`` calls after an untimed one that compiles
    the step (its seconds kept as ``evaluate_first_s`` and ``predict_first_s``;
    ``warm=False``: the first call alone, compile included: a CPU code-path check need
    not pay twice)."""
    n = min(len(x), INFER_BATCHES * batch_size)
    x, y = x[:n], y[:n]
    seconds = {"infer_samples": n}
    for name, call in (("evaluate_s", lambda: model.evaluate(x, y, batch_size=batch_size,
                                                             verbose=0)),
                       ("predict_s", lambda: model.predict(x, batch_size=batch_size,
                                                           verbose=0))):
        if warm:  # its seconds say what the compile (or the cache's load) took
            start = time.perf_counter()
            call()
            seconds[name.replace("_s", "_first_s")] = time.perf_counter() - start
        times = []
        for _ in range(INFER_REPEATS if warm else 1):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        seconds[name] = float(np.median(times))
    return seconds


def _plain(workload, model, backend, flops, compiled=False, already_warm=False):
    from kmgpu.bench import flops as flop_count

    if not compiled:
        model.compile(**compile_args(workload))
    x, y = workload.data()
    result = _fit(model.fit, x, y, workload.batch, workload, model, already_warm)
    result["weights"] = model.get_weights()
    result["params"] = trainable_count(model)
    if flops:  # plain fit, not its replay (that one is there for the training's noise)
        result.update(_infer(model, x, y, workload.batch, warm=not workload.quick))
    if flops:  # after training and after the weights are taken: never timed, never kept
        result["flops_per_sample"], result["flops_source"] = flop_count.per_sample(
            model, workload, backend, x, y)
        result["flops_analytic"] = flop_count.analytic(model)
    return result


def _kmgpu(workload, n, model, policy):
    import warnings

    import kmgpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "one device - running as a single replica"
        parallel = kmgpu.parallelize(model, gpus=n, batch=policy)
    from kmgpu import environment

    jit = environment.setting("KMGPU_BENCH_JIT_COMPILE") == "1"
    extra = {"jit_compile": True} if jit else {}
    parallel.compile(**workload.compile_args(), **extra)  # per_replica: LR x N by kmgpu
    x, y = workload.data(global_batch(workload, n, policy))
    try:
        result = _fit(parallel.fit, x, y, workload.batch, workload, model)
        weights = model.get_weights()  # the user's model holds the trained weights
        result.update(_infer(parallel, x, y, workload.batch, warm=not workload.quick))
    finally:
        if has_gpu():
            parallel.close()  # free the GPUs for the next run's memory figures
        # else: the torch engine's worker pool stays for the next run on as many devices
    result["weights"] = weights
    result["params"] = trainable_count(model)
    result["jit_compile"] = jit
    result["tf32"] = parallel._config.tf32  # on torch kmgpu's steps set it themselves
    return result


def _mirrored(workload, n, init, policy):
    """The hand-written MirroredStrategy script."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))[:n]]
    if len(devices) < n:
        raise ValueError(f"{n} devices asked for, {len(devices)} exist")
    # On GPUs MirroredStrategy's default all-reduce (NCCL); logical CPUs need another.
    ops = None if gpus else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    scale = n if policy == "per_replica" else 1
    with strategy.scope():
        model = workload.build()
        model.set_weights(init)
        model.compile(**compile_args(workload, scale))
    x, y = workload.data(global_batch(workload, n, policy))
    result = _fit(model.fit, x, y, global_batch(workload, n, policy), workload, model)
    result["weights"] = model.get_weights()
    return result


def _data_parallel(workload, n, init, policy):
    """keras.distribution.DataParallel, as the Keras distribution guide shows it."""
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices()[:n])
    scale = n if policy == "per_replica" else 1
    with distribution.scope():
        model = workload.build()
        model.set_weights(init)
        model.compile(**compile_args(workload, scale))
        x, y = workload.data(global_batch(workload, n, policy))
        result = _fit(model.fit, x, y, global_batch(workload, n, policy), workload, model)
        result["weights"] = model.get_weights()
    return result


def trainable_count(model):
    return int(sum(np.prod(w.shape, dtype=np.int64) for w in model.trainable_weights))

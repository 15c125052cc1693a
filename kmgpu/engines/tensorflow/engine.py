"""TensorFlow engine: ``tf.distribute.MirroredStrategy`` over the chosen devices.

The replica is created and compiled inside ``strategy.scope()`` (both are required
by tf.distribute). Keras splits each global batch over the replicas and scales each
replica's mean loss by 1/N (a sum not at all), which is exact only for a mean and an
even split; kmgpu's train step weighs each replica's loss by its part of the global
batch's loss (``kmgpu.engines.loss_fixes.replica_loss``: by rows, by sample weights
or 1, as the loss reduces), so a partial last batch and every reduction give the
one-device update, and an optimizer that clips clips the summed gradient.
``sync_batchnorm`` uses Keras's own ``BatchNormalization(synchronized=True)``.

What else keeps ordinary Keras code equal to one device (``keras_fixes`` says how):
a model's own ``train_step`` gets an exactly weighted, unscaled ``compute_loss``;
each output's loss is weighed by the replica's share of the batch; optimizers with
``gradient_accumulation_steps`` apply once, after the all-reduce; generators and
PyDatasets are fed per replica (``data``); after fit, local BatchNorm moving
statistics are the mean over the replicas.
"""

import contextlib

from kmgpu.engines import batch_checks
from kmgpu.engines.base import ON_BATCH, InProcessEngine
from kmgpu.engines.tensorflow import data, data_fixes, kept_input, layer_fixes, step_fixes

#: the calls whose arrays are kept across calls (``kept_input``), each with the attribute
#: by which a callback ends it early (a call stopped mid-pass keeps no iterator)
KEPT = {"fit": "stop_training", "evaluate": "stop_evaluating", "predict": "stop_predicting"}


class TensorFlowEngine(InProcessEngine):
    name = "tf.distribute.MirroredStrategy"
    no_sharding = ("tf.distribute.MirroredStrategy keeps a whole copy of the weights, the "
                   "gradients and the optimizer state on every replica")

    def __init__(self, config):
        super().__init__(config)
        import tensorflow as tf

        self._feed = {"first": None}  # the first batch of a generator fed per replica

        kind = config.devices[0][0].upper()
        logical = tf.config.list_logical_devices(kind)
        names = [logical[i].name for i in config.device_ids]
        from kmgpu.engines.tensorflow import runtime

        multi = runtime.strategy()  # several processes (kmgpu launch)
        if multi is not None:  # every device of every worker
            self.strategy, self.name = multi, "tf.distribute.MultiWorkerMirroredStrategy"
            n = multi.num_replicas_in_sync
            self.device_ids, self.device_names = list(range(n)), [f"replica:{i}" for i in range(n)]
        elif len(names) == 1:
            self.strategy = tf.distribute.OneDeviceStrategy(names[0])
            self.name = "tf.distribute.OneDeviceStrategy"
        else:
            # NCCL serves GPUs; logical CPU devices need a plain reduction.
            ops = tf.distribute.ReductionToOneDevice() if kind == "CPU" else None
            self.strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)
        self._pair_functions = _PairFunctions(self.strategy)
        # fit's training arrays, and evaluate's and predict's, each kept across calls
        # (one worker, several replicas)
        self._kept = ({m: kept_input.KeptInput(self.strategy) for m in KEPT}
                      if self._single_worker() else {})

    def scope(self):
        return self.strategy.scope()

    @contextlib.contextmanager
    def call_context(self, method):
        with step_fixes.reduce_fix(self.strategy), layer_fixes.all_reduce_without_walk(), \
                data_fixes.park_iterators(), data_fixes.untuned_iterators():
            yield

    def replica_batch(self, global_batch):
        return global_batch // self.num_replicas  # each replica runs the model on its rows

    def read_states(self, replica):
        import numpy as np

        from kmgpu.engines import replication

        return [np.concatenate([np.asarray(c) for c in
                                self.strategy.experimental_local_results(v.value)])
                for v in replication.state_variables(replica)]

    def write_states(self, replica, arrays):
        import numpy as np

        from kmgpu.engines import replication

        for v, a in zip(replication.state_variables(replica), arrays):
            components = self.strategy.experimental_local_results(v.value)
            for component, rows in zip(components, np.split(a, len(components))):
                component.assign(rows)

    def _single_worker(self):
        """Several replicas, all in this process (not one device, not multi-worker)."""
        import tensorflow as tf

        return self.num_replicas > 1 and isinstance(self.strategy,
                                                    tf.distribute.MirroredStrategy)

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        if template.compiled and self.num_replicas > 1:  # refused before any work
            kwargs = batch_checks.check_weighable(template, kwargs, method)
        self._feed["first"] = None
        guard = None if method in ON_BATCH else batch_checks.guard(
            template, method, self.num_replicas)
        try:
            result = self._run(method, template, kwargs, lr_scale, guard)
        except Exception:
            if guard is not None and guard.error is not None:
                raise guard.error from None  # tf.data hands it on as its own error type
            raise
        if guard is not None and guard.error is not None:
            # several workers: the distributed iterator ends the epoch at the refused
            # batch as if the data ran out (Keras warns "ran out of data")
            raise guard.error
        return result

    def _run(self, method, template, kwargs, lr_scale, guard):
        if method in ON_BATCH:
            try:
                return super().run(method, template, kwargs, lr_scale)
            finally:
                if method == "train_on_batch" and self._single_worker() and self.replica:
                    self._average_moving_statistics(self.replica, template)
        if self.num_replicas > 1:  # one worker or several (kmgpu launch)
            kwargs, self._feed["first"] = data.feed(self.strategy, kwargs, method,
                                                    shuffle=method == "fit"
                                                    and kwargs.get("shuffle", True),
                                                    guard=guard)
        if guard is not None:  # every batch of a tf.data dataset passes the guard too
            kwargs = data.checked(kwargs, guard, method)
        kept = None
        if method in KEPT and getattr(template, "steps_per_execution", 1) == 1:
            # several steps per execution would run past a pass's end into the next one
            import keras

            kept = self._kept.get(method) if not keras.config.max_steps_per_epoch() else None
            if method == "fit":
                kwargs = data_fixes.repeating_datasets(kwargs, kept)
            elif kept is not None:
                kwargs = data_fixes.one_pass_datasets(kwargs, method, kept)
        if method in self._kept:
            if self._kept[method].holds(kwargs.get("x")):
                self._feed["first"] = self._kept[method].first  # Keras reads no batch
            else:  # other data: the kept input's copy of the arrays goes
                kept = None
                self._kept[method].drop()
        whole_passes = False
        try:
            result = super().run(method, template, kwargs, lr_scale)
            whole_passes = not getattr(self.replica, KEPT.get(method, "stop_training"), False)
            return result
        finally:
            if kept is not None:
                kept.finished(whole_passes)
            self._feed["first"] = None
            if method == "fit" and self._single_worker() and self.replica is not None:
                self._average_moving_statistics(self.replica, template)

    def close(self):
        for kept in self._kept.values():
            kept.drop()

    def copy_back(self, pairs):
        """The replica's trained state into the template, TF variable to TF variable (the
        replica's first copy: the replicas of a MirroredVariable are equal), all in one
        traced function: an eager assign per variable would be a large part of what a loop
        of ``train_on_batch`` calls pays at every call."""
        self._pair_functions.run("copy", [(r, t) for r, t in pairs], _copy_fn)

    def same_values(self, pairs):
        """TF variables are mutable (a graph assigns them without Python seeing it): the
        template is compared with the replica's first copy, bit for bit, on the device
        (one traced comparison per call; the replicas of a MirroredVariable are equal)."""
        usable = [i for i, (t, r) in enumerate(pairs)
                  if tuple(t.shape) == tuple(r.shape) and t.dtype == r.dtype]
        out = [False] * len(pairs)
        if usable:
            same = self._pair_functions.run("same", [pairs[i] for i in usable], _same_fn)
            for i, ok in zip(usable, same.numpy()):
                out[i] = bool(ok)
        return out

    def run_on_batch(self, replica, method, kwargs):
        """Keras hands the whole batch to every replica (``strategy.run`` of plain
        tensors): give replica r its contiguous block of rows instead."""
        if not self._single_worker():
            return getattr(replica, method)(**kwargs)
        batch = {k: v for k, v in kwargs.items() if k in ("x", "y", "sample_weight")}
        first, placed = _per_replica(self.strategy, batch)
        replica._maybe_symbolic_build(data_batch=(first.get("x"), first.get("y"),
                                                  first.get("sample_weight")))
        result = getattr(replica, method)(**dict(kwargs, **placed))
        step = "train_step" if method == "train_on_batch" else "test_step"
        if method == "predict_on_batch" or step_fixes.keeps_keras_step(replica, step):
            return result  # kmgpu's own step returns the global batch's (global_logs)
        # Keras returns the mean of the replicas' own results, wrong for an uneven
        # split: read the metrics as fit does, summed over replicas
        return step_fixes.metrics_logs(replica, kwargs.get("return_dict", False))

    def _average_moving_statistics(self, replica, template):
        """Local BatchNorm: each replica kept its own moving mean and variance; the
        template gets their mean over the replicas (what torch's engine gives), not
        replica 0's statistics of 1/N of the data."""
        import keras

        from kmgpu.engines import replication

        moving = {id(v) for layer in replica._flatten_layers()
                  if isinstance(layer, keras.layers.BatchNormalization)
                  for v in (layer.moving_mean, layer.moving_variance) if v is not None}
        pairs = [(r, t) for r, t in zip(replication.weights(replica),
                                        replication.weights(template)) if id(r) in moving]
        if pairs:  # one traced function for all of them
            self._pair_functions.run("mean", pairs, _mean_fn)

    def prepare_replica(self, replica, template):
        import keras

        step_fixes.own_build(replica, self._feed, replica_fixes=self.num_replicas > 1)
        if self.num_replicas == 1:
            return
        if self.config.sync_batchnorm:
            for layer in replica._flatten_layers():
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.synchronized = True
                    layer_fixes.synced_moments(layer)
        layer_fixes.per_thread_losses(replica)  # layers run on the global batch all-gather
        step_fixes.exact_custom_steps(replica)  # the user's own train_step / test_step
        step_fixes.synced_logs(replica)
        step_fixes.global_logs(replica)  # per-batch logs of the global batch
        step_fixes.traced_reset_metrics(replica)
        step_fixes.replica_steps(replica, template)


def _per_replica(strategy, batch):
    """Replica r's contiguous block of every array in ``batch`` (sizes differ by at most
    one row; a replica of a batch smaller than N gets none), as distributed values.

    Returns:
        (replica 0's block of each array, to build the model from; the placed values).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    n = strategy.num_replicas_in_sync
    placed, first = {}, {}
    for key, value in batch.items():
        if value is None:
            placed[key] = first[key] = None
            continue
        blocks = keras.tree.map_structure(lambda a: np.array_split(np.asarray(a), n), value)
        first[key] = keras.tree.map_structure_up_to(value, lambda b: b[0], blocks)
        placed[key] = strategy.experimental_distribute_values_from_function(
            lambda ctx, blocks=blocks, value=value: keras.tree.map_structure_up_to(
                value, lambda b: tf.constant(b[ctx.replica_id_in_sync_group]), blocks))
    return first, placed


class _PairFunctions:
    """One traced function per kind of work over (Keras variable, Keras variable) pairs,
    kept while the pairs stay the same variables: calls in a loop then run one graph
    instead of an eager op per variable (and trace nothing new). ``make`` gets each
    pair as the lists of its variables' copies (``_copies``)."""

    def __init__(self, strategy):
        self.strategy, self._made = strategy, {}
        self.traces = 0  # functions made, for tests

    def _copies(self, variable):
        """The TF variables of a Keras variable: each replica's copy, or the one."""
        import tensorflow as tf

        value = variable.value
        if isinstance(value, tf.distribute.DistributedValues):
            return self.strategy.experimental_local_results(value)
        return [value]

    def run(self, kind, pairs, make):
        import tensorflow as tf

        key = tuple((id(a), id(b)) for a, b in pairs)
        made = self._made.get(kind)
        if made is None or made[0] != key:
            copies = [(self._copies(a), self._copies(b)) for a, b in pairs]
            self._made[kind] = made = (key, tf.function(make(copies), autograph=False),
                                       pairs)  # the pairs: their ids stay theirs
            self.traces += 1
        return made[1]()


def _copy_fn(copies):
    """Each pair's first variable (its first copy: the copies of a MirroredVariable are
    equal) assigned to its second (a template variable)."""
    def copy():
        for sources, (target,) in copies:
            target.assign(sources[0].read_value())
    return copy


def _mean_fn(copies):
    """Each pair's second variable (a template variable) assigned the mean of the first
    one's copies (a replica variable kept per replica, as local BatchNorm's statistics)."""
    import tensorflow as tf

    def mean():
        for sources, (target,) in copies:
            target.assign(tf.reduce_mean(tf.stack([s.read_value() for s in sources]), 0))
    return mean


def _bits(a):
    import tensorflow as tf

    if a.dtype.is_floating:
        return tf.bitcast(a, {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}[a.dtype.size])
    return a


def _same_fn(copies):
    """Whether each pair's variables (their first copies) hold the same bits."""
    import tensorflow as tf

    def same():
        return tf.stack([tf.reduce_all(tf.equal(_bits(a[0].read_value()),
                                                _bits(b[0].read_value())))
                         for a, b in copies])
    return same

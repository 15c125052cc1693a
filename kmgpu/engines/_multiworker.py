"""Several processes (hosts) in one job, per backend: start-up and the few fixes the
TensorFlow and JAX engines need on top of their single-process path.

``kmgpu launch`` calls ``start`` in every process before the user's script runs;
the engines ask ``tf_strategy()`` / ``jax_multiprocess()`` whether they are in such
a job. Each backend's own engine does the communication: TensorFlow's
``MultiWorkerMirroredStrategy``, ``jax.distributed`` (through
``keras.distribution.initialize``), torch's process group (the torch engine's own).
"""

import contextlib
import json
import os

_STRATEGY = []  # the MultiWorkerMirroredStrategy made at start-up (at most one)


def start(backend, job):
    """Initialise this process's multi-process runtime, before any backend op runs.

    Args:
        backend: "tensorflow", "jax" or "torch".
        job: this process's ``kmgpu.launch.Job``.
    """
    if backend == "tensorflow":
        if "TF_CONFIG" not in os.environ:
            os.environ["TF_CONFIG"] = _tf_config_for(job)
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        _STRATEGY.append(strategy)
        _tf_common_seed(strategy)
    elif backend == "jax":
        import keras

        # jax.distributed: process 0 serves the coordinator on MASTER_PORT + 1
        # (under torchrun, MASTER_PORT itself is torchrun's store).
        keras.distribution.initialize(f"{job.master_addr}:{job.master_port + 1}",
                                      job.world, job.rank)
    else:  # torch: the engine joins the group from torchrun's variables
        os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world),
                          LOCAL_RANK=str(job.local_rank), MASTER_ADDR=job.master_addr,
                          MASTER_PORT=str(job.master_port),
                          LOCAL_WORLD_SIZE=str(job.local_world))
        return
    _warm_saving()


def _warm_saving():
    """Saving a model makes throw-away Keras objects once per type (an Optimizer, with
    a variable) to learn which attributes to skip. Made by process 0 alone inside
    fit (ModelCheckpoint), that variable would join a collective the other
    processes never enter: TensorFlow fails ("Collective instance ... expected
    type"), JAX asserts. Every process makes them here, outside any scope, and they
    are cached under the name Keras 3.15 looks them up by (it stores them as
    "saving_attr_skipset_*" but reads "saving_attr_skiplist_*", so its own cache
    never hits).
    """
    from keras.src.backend.common import global_state
    from keras.src.saving import saving_lib

    for kind in ("Operation", "Layer", "Functional", "Sequential", "Metric", "Optimizer",
                 "Loss"):
        global_state.set_global_attribute(f"saving_attr_skiplist_{kind}",
                                          saving_lib.get_attr_skipset(kind))


def _tf_common_seed(strategy):
    """One Keras seed for every worker, drawn by worker 0 (what keras.distribution's
    initialize does for JAX), set before the script runs: unseeded models start from
    the same weights everywhere. A seed the script sets is the same everywhere anyway.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    local = np.random.randint(1, 2**31 - 1)

    def contribution():
        first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
        return tf.cast(first, tf.int64) * local

    seed = strategy.reduce("SUM", strategy.run(contribution), axis=None)
    keras.utils.set_random_seed(int(seed))


def _tf_config_for(job):
    """TF_CONFIG from a SLURM step: every task's host from the node list."""
    from kmgpu import launch

    if job.source != "slurm":
        if job.world != job.local_world:
            raise RuntimeError(
                "TensorFlow needs every worker's address (TF_CONFIG), which torchrun does "
                "not give on several hosts: start the script with `kmgpu launch` on every "
                "host instead, or set TF_CONFIG yourself.")
        return launch.tf_config([job.master_addr], job.world, job.rank, job.master_port)
    hosts = launch.expand_hostlist(os.environ.get("SLURM_STEP_NODELIST")
                                   or os.environ["SLURM_JOB_NODELIST"])
    return launch.tf_config(hosts, job.local_world, job.rank, job.master_port)


# -- TensorFlow -------------------------------------------------------------------
def tf_strategy():
    """The job's MultiWorkerMirroredStrategy, or None outside a multi-worker job.

    Raises:
        RuntimeError: TF_CONFIG names several workers but the strategy was not made
            at start-up (TensorFlow allows it only before the first op).
    """
    if _STRATEGY:
        return _STRATEGY[0]
    config = os.environ.get("TF_CONFIG")
    if config and len(json.loads(config).get("cluster", {}).get("worker", [])) > 1:
        raise RuntimeError(
            "TF_CONFIG names several workers, but MultiWorkerMirroredStrategy can only be "
            "created before TensorFlow runs its first op, i.e. before your script builds "
            "a model: start the script with `kmgpu launch script.py` (also under srun).")
    return None


@contextlib.contextmanager
def tf_reduce_fix(strategy):
    """Keras 3.15's TF trainer reduces multi-worker step outputs with
    ``strategy.reduce("MEAN", v, axis=0)``, which fails on scalar metrics
    ("Invalid reduction dimension 0 for input with 0 dimensions", keras #20585).
    Within the block, a mean over all replicas (``axis=None``) is used instead.
    """
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(
                strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    trainer.reduce_per_replica = reduce_per_replica
    try:
        yield
    finally:
        trainer.reduce_per_replica = original


# -- JAX ----------------------------------------------------------------------------
def jax_multiprocess():
    """True when JAX runs several processes (jax.distributed is initialised)."""
    import jax

    return jax.process_count() > 1


def jax_put_global(data, mesh, batch_axis):
    """Place each global batch on the mesh of every process's devices.

    Every process holds the same full batch; each gives its own devices their rows
    (``make_array_from_callback``), sharded along the batch axis when the device
    count divides it, replicated otherwise (the single-process rule).
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from keras.src import tree

    n = mesh.devices.size

    def put(d):
        if d is None:
            return None
        d = np.asarray(d)
        spec = PartitionSpec(batch_axis) if d.shape and d.shape[0] % n == 0 else PartitionSpec()
        return jax.make_array_from_callback(d.shape, NamedSharding(mesh, spec),
                                            lambda index: d[index])

    return tree.map_structure(put, data)


def jax_replicated_predictions(replica, mesh):
    """Make ``predict`` outputs replicated, so every process can read all rows
    (a batch-sharded output spans other processes' devices)."""
    import types

    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from keras.src import tree

    replicated = NamedSharding(mesh, PartitionSpec())
    step = replica.predict_step

    def predict_step(self, state, data):  # Keras's JAX trainer: (outputs, state)
        outputs, non_trainable = step(state, data)
        return tree.map_structure(
            lambda t: jax.lax.with_sharding_constraint(t, replicated), outputs), non_trainable

    replica.predict_step = types.MethodType(predict_step, replica)

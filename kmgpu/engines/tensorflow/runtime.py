"""TensorFlow's devices, simulated devices, memory and multi-worker start-up.

The same plain functions as every backend's ``runtime.py``. Nothing here imports
TensorFlow at module import time.
"""

import json
import os

_STRATEGY = []  # the MultiWorkerMirroredStrategy made at start-up (at most one)


def physical_devices():
    """The devices ``gpus=None`` would use: [("gpu", i), ...], else [("cpu", i), ...].

    Logical devices, so that simulated CPU devices count.
    """
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [("gpu", i) for i in range(len(gpus))]
    return [("cpu", i) for i in range(len(tf.config.list_logical_devices("CPU")))]


def simulate(n):
    """Split the CPU into ``n`` logical devices (and hide GPUs).

    Returns:
        None, or what TensorFlow already set up (a description) when it is too late.
    """
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_visible_devices([], "GPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = tf.config.list_logical_devices("CPU")
        if len(have) == n and not tf.config.list_logical_devices("GPU"):
            return None
        return f"{len(have)} CPU device(s)"
    return None


def peak_memory():
    """GPU:0's allocator peak in bytes, or None without a GPU."""
    try:
        import tensorflow as tf

        if tf.config.list_logical_devices("GPU"):
            return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    except Exception:
        pass
    return None


def reset_peak_memory():
    """Restart GPU:0's peak-memory counter (nothing on CPU)."""
    try:
        import tensorflow as tf

        if tf.config.list_logical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")
    except Exception:
        pass


def start_job(job):
    """Make the job's ``MultiWorkerMirroredStrategy`` before any TensorFlow op runs.

    Args:
        job: this process's ``kmgpu.environment.Job``.
    """
    if "TF_CONFIG" not in os.environ:
        os.environ["TF_CONFIG"] = _tf_config_for(job)
    import tensorflow as tf

    from kmgpu.engines import model_fixes

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    _STRATEGY.append(strategy)
    _common_seed(strategy)
    model_fixes.warm_saving()


def strategy():
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


def _common_seed(strategy):
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
    """TF_CONFIG from a SLURM step (every task's host from the node list) or torchrun."""
    from kmgpu import environment

    if job.source != "slurm":
        if job.world != job.local_world:
            raise RuntimeError(
                "TensorFlow needs every worker's address (TF_CONFIG), which torchrun does "
                "not give on several hosts: start the script with `kmgpu launch` on every "
                "host instead, or set TF_CONFIG yourself.")
        return environment.tf_config([job.master_addr], job.world, job.rank, job.master_port)
    hosts = environment.expand_hostlist(os.environ.get("SLURM_STEP_NODELIST")
                                        or os.environ["SLURM_JOB_NODELIST"])
    return environment.tf_config(hosts, job.local_world, job.rank, job.master_port)

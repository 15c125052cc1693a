"""TensorFlow engine: ``tf.distribute.MirroredStrategy`` over the chosen devices.

The replica is created and compiled inside ``strategy.scope()`` (both are required
by tf.distribute). Keras splits each global batch over the replicas and scales each
replica's loss by 1/N, which is exact only when the split is even; kmgpu's train
step weights each replica's loss by its share of the global batch, so a partial
last batch gives the one-device update. ``sync_batchnorm`` uses Keras's own
``BatchNormalization(synchronized=True)``.
"""

import types

from kmgpu.engines.base import InProcessEngine
from kmgpu.engines.tensorflow import keras_fixes


class TensorFlowEngine(InProcessEngine):
    name = "tf.distribute.MirroredStrategy"

    def __init__(self, device_ids, available, options):
        super().__init__(device_ids, available, options)
        import tensorflow as tf

        kind = available[device_ids[0]][0].upper()
        logical = tf.config.list_logical_devices(kind)
        names = [logical[i].name for i in device_ids]
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

    def scope(self):
        return self.strategy.scope()

    def call_context(self, method):
        return keras_fixes.reduce_fix(self.strategy)

    def replica_batch(self, global_batch):
        return global_batch // self.num_replicas  # each replica runs the model on its rows

    def read_states(self, replica):
        import numpy as np

        from kmgpu import models

        return [np.concatenate([np.asarray(c) for c in
                                self.strategy.experimental_local_results(v.value)])
                for v in models.state_variables(replica)]

    def write_states(self, replica, arrays):
        import numpy as np

        from kmgpu import models

        for v, a in zip(models.state_variables(replica), arrays):
            components = self.strategy.experimental_local_results(v.value)
            for component, rows in zip(components, np.split(a, len(components))):
                component.assign(rows)

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        if method == "fit":
            kwargs = keras_fixes.repeating_datasets(kwargs)
        return super().run(method, template, kwargs, lr_scale)

    def prepare_replica(self, replica, template):
        import keras

        if self.num_replicas == 1:
            return
        if self.options.sync_batchnorm:
            for layer in replica._flatten_layers():
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.synchronized = True
        if keras_fixes.keeps_keras_train_step(template):
            replica.train_step = types.MethodType(keras_fixes.train_step, replica)
        replica._maybe_symbolic_build = types.MethodType(keras_fixes.symbolic_build, replica)

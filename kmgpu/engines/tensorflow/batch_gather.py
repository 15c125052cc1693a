"""The global batch as one TensorFlow replica's step reaches it (``global_losses.Batch``),
through its replica context: ``all_gather`` concatenates the replicas' rows in replica
order (any row counts, none included) and sums the gradients of each replica's rows over
the replicas."""

import contextlib

from kmgpu.engines import global_losses


class ReplicaBatch(global_losses.Batch):
    """Args: context: the replica context of the step; x: this replica's inputs;
    training: a train step's (``global_losses.Batch.training``)."""

    def __init__(self, context, x, training=True):
        import keras
        import tensorflow as tf

        self.training = training
        first = [t for t in keras.tree.flatten(x) if t is not None][0]
        self.context, self.static = context, first.shape[0]
        self.rows = tf.shape(first)[0]
        self._offset, self._global = None, False  # the static rows of a gathered tensor

    def is_local(self, t):
        return t.shape[0] is None or t.shape[0] == self.static

    def is_global(self, t):
        return self._global is not False and t.shape[0] == self._global

    def gather(self, t):
        import tensorflow as tf

        if t.dtype == tf.bool:
            out = tf.cast(self.context.all_gather(tf.cast(t, tf.int8), axis=0), tf.bool)
        else:
            out = self.context.all_gather(t, axis=0)
        if self._global is False:
            self._global = out.shape[0]
        return out

    def mine(self, t):
        import tensorflow as tf

        if self._offset is None:  # rows of the replicas before this one
            sizes = self.context.all_gather(tf.reshape(self.rows, [1]), axis=0)
            self._offset = tf.reduce_sum(sizes[:self.context.replica_id_in_sync_group])
        return t[self._offset:self._offset + self.rows]


def on_global(x, training=True):
    """``global_losses.on_global`` for this replica's train (or test) step on inputs
    ``x`` (nothing with one replica or outside a replica context)."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1 or x is None:
        return contextlib.nullcontext()
    return global_losses.on_global(ReplicaBatch(context, x, training))

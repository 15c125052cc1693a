"""Keras optimizers on tf.distribute replicas: gradient accumulation and EMA overwrites
applied once after the all-reduce, clipping of the summed gradient, and a loss-scale
optimizer's finite check over every replica. Rows of
``kmgpu/engines/tensorflow/keras_fixes.py``.
"""

import threading

from kmgpu.engines import keras_fixes


def accumulate_across_replicas(optimizer):
    """``gradient_accumulation_steps`` under tf.distribute: Keras applies or accumulates
    in a ``cond`` whose update branch needs a ``merge_call``, which tf.distribute refuses
    (keras-team/keras#17429); so does ``use_ema`` with ``ema_overwrite_frequency`` (a
    ``cond`` that overwrites the variables with their averages). The replicas' gradients
    are summed here instead (the same all-reduce Keras does) and the optimizer's own
    ``apply`` runs once, in cross-replica context, where its ``cond`` holds only plain
    per-device updates.
    """
    import tensorflow as tf

    ema_overwrite = optimizer.use_ema and optimizer.ema_overwrite_frequency
    if not (optimizer.gradient_accumulation_steps or ema_overwrite):
        return

    def direct_when_merged(original):
        def maybe_merge_call(fn, strategy, *args, **kwargs):
            if tf.distribute.in_cross_replica_context():  # already merged: call it
                return fn(strategy, *args, **kwargs)
            return original(fn, strategy, *args, **kwargs)
        return maybe_merge_call

    def once(apply):
        def apply_once(grads, trainable_variables=None):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return apply(grads, trainable_variables)
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            for i, g in zip(present, context.all_reduce("sum", [grads[i] for i in present])):
                grads[i] = g

            def merged(strategy, grads):
                first = [None if g is None else strategy.experimental_local_results(g)[0]
                         for g in grads]
                with keras_fixes.swapped(  # while Keras's cond is traced
                        (tf.__internal__.distribute.interim, "maybe_merge_call",
                         direct_when_merged)):
                    return apply(first, trainable_variables)

            return context.merge_call(merged, args=(grads,))
        return apply_once

    keras_fixes.install(optimizer, "apply", once, key="accumulate_across_replicas")


def reduce_before_clipping(optimizer):
    """An optimizer that clips (``global_clipnorm``, ``clipnorm``, ``clipvalue``) clips
    the summed gradient of all replicas, as one device clips its batch's gradient:
    within a replica the gradients are all-reduced first, then clipped, and Keras's
    own all-reduce after clipping is skipped for them.
    """
    import tensorflow as tf

    if not (optimizer.global_clipnorm or optimizer.clipnorm or optimizer.clipvalue):
        return
    reduced = threading.local()  # replicas trace in threads

    def summed_first(clip):
        def clip_summed(grads):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return clip(grads)
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            for i, g in zip(present, context.all_reduce("sum", [grads[i] for i in present])):
                grads[i] = g
            reduced.done = True
            return clip(grads)
        return clip_summed

    def once(all_reduce):
        def all_reduce_once(grads_and_vars):
            if getattr(reduced, "done", False):
                reduced.done = False
                return list(grads_and_vars)
            return all_reduce(grads_and_vars)
        return all_reduce_once

    if keras_fixes.install(optimizer, "_clip_gradients", summed_first,
                           key="reduce_before_clipping"):
        keras_fixes.install(optimizer, "_all_reduce_sum_gradients", once)


def finite_over_replicas(optimizer):
    """A ``LossScaleOptimizer`` (``mixed_float16``) applies the update only when the
    gradients of every replica are finite, and halves its scale otherwise, as one device
    decides from its whole batch's gradient: each replica's "finite" flag is all-reduced
    (Keras takes the first replica's flag, before the gradients are summed).
    """
    import tensorflow as tf
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    if not isinstance(optimizer, LossScaleOptimizer):
        return

    def over_replicas(check):
        def check_finite(grads):
            finite = check(grads)
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return finite
            overflowed = context.all_reduce("sum", 1.0 - tf.cast(finite, "float32"))
            return tf.equal(overflowed, 0.0)
        return check_finite

    def if_finite(tf_apply):
        def apply_if_finite(grads, trainable_variables=None):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1 or \
                    tf.__internal__.distribute.strategy_supports_no_merge_call():
                return tf_apply(grads, trainable_variables)  # its check_finite: the one above
            finite = optimizer.check_finite(grads)  # the same on every replica

            def cross_replica(strategy, grads, trainable_variables, finite):
                def apply():
                    strategy.extended.call_for_each_replica(
                        optimizer._stateful_handle_finite_grads,
                        args=(grads, trainable_variables))

                # a cond in cross-replica context, as Keras's (a branch merges)
                tf.cond(strategy.experimental_local_results(finite)[0], apply,
                        optimizer._stateful_handle_non_finite_grads)

            context.merge_call(cross_replica, args=(grads, trainable_variables, finite))
        return apply_if_finite

    if keras_fixes.install(optimizer, "check_finite", over_replicas,
                           key="finite_over_replicas"):
        keras_fixes.install(optimizer, "_tf_apply", if_finite)

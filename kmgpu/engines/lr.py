"""Learning-rate scaling for larger global batches (Goyal et al. 2017).

The linear scaling rule multiplies the rate by ``factor`` (N, the replica count,
when ``batch="per_replica"``); warm-up ramps it from the base rate to
``factor x base`` over the first ``warmup_epochs``. The user's optimizer keeps the
*base* rate: kmgpu scales only the replica's copy, so a second fit never scales
twice and ``model.optimizer`` stays as the user configured it.

- A float rate is a variable: ``LRScaling`` (a Keras callback that runs before the
  user's) sets the replica's rate to ``base x factor(epoch)`` at each epoch start
  and puts the base back at each epoch end, so ReduceLROnPlateau and
  LearningRateScheduler keep reading and writing unscaled rates; whatever base they
  set is written back to the user's optimizer. The ramp moves once per epoch (on
  JAX, Keras reads optimizer variables only at epoch boundaries).
- A ``LearningRateSchedule`` cannot be set by callbacks; the replica gets
  ``ScaledSchedule(schedule, factor, warmup_steps)``, which ramps per step.
"""

import keras


def ramp(factor, warmup_epochs, epoch):
    """The multiplier for an epoch: linear from 1 to ``factor`` over the warm-up."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return factor
    return 1.0 + (factor - 1.0) * epoch / warmup_epochs


@keras.saving.register_keras_serializable(package="kmgpu")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``schedule(step) x (1 + (factor - 1) x min(1, step / warmup_steps))``."""

    def __init__(self, schedule, factor, warmup_steps=0):
        self.schedule = schedule
        self.factor = float(factor)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        base = self.schedule(step)
        if self.warmup_steps <= 0:
            return base * self.factor
        progress = keras.ops.minimum(
            keras.ops.cast(step, "float32") / float(self.warmup_steps), 1.0)
        return base * (1.0 + (self.factor - 1.0) * keras.ops.cast(progress, base.dtype))

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                "factor": self.factor, "warmup_steps": self.warmup_steps}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def is_schedule(optimizer):
    return isinstance(getattr(optimizer, "_learning_rate", None),
                      keras.optimizers.schedules.LearningRateSchedule)


class LRScaling:
    """Scales the replica's float learning rate per epoch and keeps the user's base.

    Two Keras callbacks share this state: ``head`` goes before the user's callbacks
    and puts the base rate back at each epoch end (so ReduceLROnPlateau reads and
    writes unscaled rates); ``tail`` goes after them, picks up any base rate they
    set (LearningRateScheduler at epoch start, ReduceLROnPlateau at epoch end),
    applies the factor at epoch start and writes the base to the user's optimizer.

    Args:
        user_optimizer: the template's optimizer (holds the base rate).
        factor: the multiplier after warm-up.
        warmup_epochs: epochs of linear ramp from 1 to ``factor``.
    """

    def __init__(self, user_optimizer, factor, warmup_epochs):
        self.user_optimizer = user_optimizer
        self.factor = float(factor)
        self.warmup_epochs = warmup_epochs
        self.base = None
        self.scaled = None
        self.head, self.tail = _Head(self), _Tail(self)

    def wrap(self, callbacks):
        return [self.head, *(callbacks or []), self.tail]


def _rate(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class _Head(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_begin(self, logs=None):
        self.state.base = _rate(self.state.user_optimizer)
        if self.model.optimizer is not self.state.user_optimizer:
            self.model.optimizer.learning_rate = self.state.base

    def on_epoch_end(self, epoch, logs=None):
        if self.state.factor != 1.0:
            self.model.optimizer.learning_rate = self.state.base


class _Tail(keras.callbacks.Callback):
    """With factor 1 on the user's own optimizer there is nothing to do per epoch (a
    read of the rate is a device sync on JAX and torch: kept off that path)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        s = self.state
        if s.factor == 1.0:
            return  # ramp(1, ...) is 1: the rate stays what it is
        s.base = _rate(self.model.optimizer)  # a LearningRateScheduler may have set it
        s.scaled = s.base * ramp(s.factor, s.warmup_epochs, epoch)
        self.model.optimizer.learning_rate = s.scaled

    def on_epoch_end(self, epoch, logs=None):
        s = self.state
        if s.factor == 1.0 and self.model.optimizer is s.user_optimizer:
            return
        s.base = _rate(self.model.optimizer)  # ReduceLROnPlateau may have lowered it
        s.user_optimizer.learning_rate = s.base
        if logs is not None and s.factor != 1.0:  # the rate this epoch trained with
            logs["learning_rate"] = s.scaled

"""Data as Keras's torch trainer reads it, for the driver's feed: fit's validation split,
the epoch iterator over a dataset, generator or DataLoader, and what one of fit's
validations draws from torch's global generator. Rows of
``kmgpu/engines/torch/keras_fixes.py``.
"""


def train_validation_split(arrays, validation_split):
    """Keras's own cut of (x, y, sample_weight) for ``validation_split``.

    Returns:
        ((x, y, sample_weight) to train on, (x, y, sample_weight) to validate on).
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def epoch_iterator(x, steps_per_epoch=None, build=None):
    """Keras's own ``TorchEpochIterator`` over a dataset, made as fit makes it:
    ``build``'s symbolic build first (a model: fit and evaluate; None: predict), then
    reset. Iterating it once gives one epoch's batches as ``(step, step, [batch])``,
    torch tensors (``feeds.read_pass`` reads them on the CPU, as NumPy).
    """
    from keras.src.backend.torch.trainer import TorchEpochIterator

    iterator = TorchEpochIterator(x=x, steps_per_epoch=steps_per_epoch)
    if build is not None:
        build._symbolic_build(iterator=iterator)
    iterator.reset()
    return iterator


def validation_draws(validation_data, batch_size, steps, steps_per_execution):
    """A function that draws from torch's global generator what one of Keras's fit
    validations over arrays draws, reading no batch.

    Keras's evaluate over fit's cached ``TorchEpochIterator`` resets it and makes a
    DataLoader iterator when the pass starts and another once it has taken every
    batch; each draws a base seed from the global generator (arrays in order draw
    nothing else). Enumerating the same iterator's epoch without fetching makes
    those iterators at the same points.

    Args:
        validation_data: fit's validation arrays, (x, y) or (x, y, sample_weight).
        batch_size: the validation batch Keras takes (None: its default).
        steps: validation_steps.
        steps_per_execution: the model's.
    """
    import keras
    from keras.src.backend.torch.trainer import TorchEpochIterator

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
    iterator = TorchEpochIterator(x=x, y=y, sample_weight=sample_weight,
                                  batch_size=batch_size, steps_per_epoch=steps,
                                  shuffle=False, steps_per_execution=steps_per_execution)

    def draw():
        iterator.reset()
        for _ in iterator._enumerate_iterator():
            pass

    return draw

"""Python data (generators, PyDatasets) as Keras reads it, for a feed per replica.
Rows of ``kmgpu/engines/keras_fixes.py``.
"""


def standardize_batch(batch, class_weight=None):
    """A generator's batch as Keras reads it: (x,), (x, y) or (x, y, sample_weight)."""
    import numpy as np
    from keras.src.trainers.data_adapters import data_adapter_utils

    if isinstance(batch, dict) or isinstance(batch, np.ndarray):
        batch = (batch,)
    batch = tuple(batch)
    if class_weight is not None and len(batch) == 2:
        batch += (data_adapter_utils.class_weight_to_sample_weights(batch[1], class_weight),)
    return batch


def py_dataset_pass(dataset, shuffle=False, class_weight=None):
    """One pass over a PyDataset through Keras's own adapter (its workers, its batch
    shuffling, its class weights), with the dataset's epoch hooks around it; endless
    for a PyDataset without length."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    adapter = PyDatasetAdapter(dataset, class_weight=class_weight, shuffle=shuffle)
    adapter.on_epoch_begin()
    try:
        yield from adapter._get_iterator()
    finally:
        adapter.on_epoch_end()

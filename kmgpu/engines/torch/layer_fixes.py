"""Keras layers on torch replicas: BatchNormalization's moments over the global batch
(``sync_batchnorm=True``), and stateful RNNs run from a copy of their states. Rows of
``kmgpu/engines/torch/keras_fixes.py``.
"""

from kmgpu.engines import keras_fixes


def global_batch_moments(layer, sum_over_ranks, real_rows):
    """Replace a BatchNormalization layer's ``_moments`` by moments over the global batch.

    Args:
        layer: a ``keras.layers.BatchNormalization`` of a replica.
        sum_over_ranks: a differentiable all-reduce (sum) of one tensor.
        real_rows: ``real_rows()`` is the number of real rows of this rank's batch
            inside a train step, None outside one (then the layer's own moments).
    """
    keras_fixes.install(layer, "_moments", lambda local: _global_moments(
        layer, local, sum_over_ranks, real_rows))


def _global_moments(layer, local, sum_over_ranks, real_rows):
    """``global_batch_moments``' moments for ``layer`` (``local``: the layer's own)."""
    import numpy as np
    import torch

    def moments(inputs, mask):
        n_real = real_rows()
        if n_real is None:
            return local(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs[:n_real]
        if mask is None:
            count = float(np.prod([x.shape[a] for a in axes]))
            s1 = torch.sum(x, dim=axes)
            s2 = torch.sum(x * x, dim=axes)
            n = torch.full_like(s1, count)
        else:
            w = mask[:n_real].to(x.dtype)
            w = torch.broadcast_to(w.unsqueeze(-1), x.shape)
            s1 = torch.sum(x * w, dim=axes)
            s2 = torch.sum(x * x * w, dim=axes)
            n = torch.sum(w, dim=axes)
        total = sum_over_ranks(torch.stack([s1, s2, n]))
        mean = total[0] / total[2]
        variance = total[1] / total[2] - mean * mean
        return mean, variance

    return moments


def copy_states_in(layer):
    """Run a stateful RNN layer from a copy of its states (this replica only).

    Keras 3.15's torch LSTM and GRU kernels (``backend.lstm`` / ``backend.gru``,
    which bypass ``RNN.inner_loop``'s own copy) multiply by the state variable's
    tensor itself, so autograd saves it; ``RNN.call`` then ``assign``s the new
    states into that tensor in place and ``backward`` fails ("modified by an
    inplace operation"). Given a copy as ``initial_state``, the layer computes
    the same and its own assign still carries the states to the next batch.
    """
    import keras

    def from_copy(call):
        def call_from_copy(sequences, initial_state=None, **kwargs):
            if initial_state is None:
                initial_state = keras.tree.map_structure(lambda v: v.value.clone(),
                                                         layer.states)
            return call(sequences, initial_state=initial_state, **kwargs)
        return call_from_copy

    keras_fixes.install(layer, "call", from_copy)

"""Keras layers on torch replicas: BatchNormalization's moments over the global batch
(``sync_batchnorm=True``), stateful RNNs run from a copy of their states, and variables
made without memory (``unfilled_variables``, for ``optim.unfilled``). Rows of
``kmgpu/engines/torch/keras_fixes.py``.
"""

from kmgpu.engines import keras_fixes


def unfilled_variables(select):
    """Within the block, a Keras variable made from an initializer that ``select(variable)``
    picks gets a tensor of its shape and dtype whose memory is freed at once; its
    initializer is not run (Keras makes every variable with an initializer, a layer's
    weights and an optimizer's slots, through ``_initialize_with_initializer``)."""
    import torch
    from keras.src.backend.common.variables import Variable
    from keras.src.backend.torch.core import get_device, to_torch_dtype

    def make(initialize):
        def initialize_unfilled(self, initializer):
            if not select(self):
                return initialize(self, initializer)
            value = torch.empty(tuple(self.shape), dtype=to_torch_dtype(self.dtype),
                                device=get_device())
            value.untyped_storage().resize_(0)
            self._initialize(value)

        return initialize_unfilled

    return keras_fixes.swapped((Variable, "_initialize_with_initializer", make))


def global_batch_moments(layer, sum_over_ranks, real_rows, rank, world):
    """Replace a BatchNormalization layer's ``_moments`` by moments over the global batch.

    Each rank computes its count, mean and sum of squared differences from that mean
    over its real rows; one all-reduce gathers every rank's three, and each rank combines
    them (Chan et al.'s parallel variance, as torch's ``SyncBatchNorm``). The variance
    keeps float32's digits where E[x^2] - E[x]^2 from summed powers would cancel: when a
    channel's mean is large against its spread the two terms agree in most of their
    digits.

    Args:
        layer: a ``keras.layers.BatchNormalization`` of a replica.
        sum_over_ranks: a differentiable all-reduce (sum) of one tensor.
        real_rows: ``real_rows()`` is the number of real rows of this rank's batch
            inside a train step, None outside one (then the layer's own moments).
        rank: this rank's index in the group.
        world: the number of ranks.
    """
    keras_fixes.install(layer, "_moments", lambda local: _global_moments(
        layer, local, sum_over_ranks, real_rows, rank, world))


def _global_moments(layer, local, sum_over_ranks, real_rows, rank, world):
    """``global_batch_moments``' moments for ``layer`` (``local``: the layer's own)."""
    import numpy as np
    import torch

    def nonzero(n):  # a divisor: a rank (or channel) with no real rows divides 0 by 1
        return torch.where(n > 0, n, torch.ones_like(n))

    def moments(inputs, mask):
        n_real = real_rows()
        if n_real is None:
            return local(inputs, mask)
        axes = list(layer._reduction_axes)
        x = inputs[:n_real]
        if mask is None:
            w = None
            sums = torch.sum(x, dim=axes, keepdim=True)
            n = torch.full_like(sums.reshape(-1),
                               float(np.prod([x.shape[a] for a in axes])))
        else:
            w = mask[:n_real].to(x.dtype)
            w = torch.broadcast_to(w.unsqueeze(-1), x.shape)
            sums = torch.sum(x * w, dim=axes, keepdim=True)
            n = torch.sum(w, dim=axes)
        mean = sums / nonzero(n).reshape(sums.shape)
        # the local mean held constant: the squared differences' gradient through it is
        # their sum's derivative at its minimum, zero (as tf.nn.moments does)
        squares = torch.square(x - mean.detach())
        m2 = torch.sum(squares if w is None else squares * w, dim=axes)
        mine = torch.stack([n, mean.reshape(-1), m2])  # (3, C)
        # every rank's row: zeros but this rank's, summed over ranks (an all-gather
        # through the differentiable sum)
        zeros = mine.new_zeros((1,) + tuple(mine.shape))
        rows = sum_over_ranks(torch.cat([zeros] * rank + [mine[None]]
                                        + [zeros] * (world - 1 - rank)))
        counts, means, m2s = rows.unbind(1)  # each (world, C)
        n_all = nonzero(torch.sum(counts, dim=0))
        global_mean = torch.sum(counts * means, dim=0) / n_all
        spread = torch.sum(counts * torch.square(means - global_mean), dim=0)
        return global_mean, (torch.sum(m2s, dim=0) + spread) / n_all

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

"""Keras's own train step on the torch ranks: the replica inside DistributedDataParallel.

``wrap`` gives DDP the replica's trainable variables as its parameters
(``TrainableWeights``), their gradients in DDP's buckets (no copies), summed over ranks
by kmgpu's comm hook (``collectives.sum_gradients``: the step weighs each rank's loss
by its share of the global batch, so the sum is the global batch's gradient).
"""

import torch

from kmgpu.engines.torch import collectives


def wrap(replica, device):
    """The replica's ``DistributedDataParallel`` on ``device`` (a torch device)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        TrainableWeights(replica),
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in DDP's buckets: no copies
        **no_buffer_sync(),
    )
    ddp.register_comm_hook(None, collectives.sum_gradients)
    return ddp


class TrainableWeights(torch.nn.Module):
    """The replica as DDP sees it: its trainable variables' tensors are this module's
    parameters, its forward pass is the replica's call.

    Keras registers a layer's variables with torch (``torch_params``) through
    ``nn.Module.__setattr__``; a model class with a ``__setattr__`` of its own (keras-hub's
    backbones and tasks on torch) stores them where ``parameters()`` does not look, and
    DDP, given the replica itself, finds no parameter to synchronise."""

    def __init__(self, replica):
        super().__init__()
        self.trainable = torch.nn.ParameterList([v.value for v in replica.trainable_weights])
        object.__setattr__(self, "replica", replica)  # not a submodule: the list holds its weights

    def forward(self, *args, **kwargs):
        return self.replica(*args, **kwargs)


def no_buffer_sync():
    """Keras keeps no torch buffers; the argument's name changed in torch 2.13."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    try:
        params = inspect.signature(DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}

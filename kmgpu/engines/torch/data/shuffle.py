"""The order of a shuffled pass: the one plain Keras draws on one device.

Keras 3.15.1's torch trainer shuffles arrays with a ``DataLoader`` over a
``RandomSampler`` (``shuffle=True``: one seed drawn from torch's default CPU generator
when a pass starts, then ``randperm`` on a generator of that seed) or a batch sampler
that permutes each batch's rows with ``torch.randperm`` (``shuffle="batch"``); every
``DataLoader`` iterator also draws a base seed from that generator. A ``PyDataset``'s
batches are shuffled with Python's ``random.shuffle``. So a seeded script's order is a
function of those two host states when each pass starts.

kmgpu's ranks run Keras's ``fit`` over a ``RankSlices`` dataset, whose ``DataLoader``
draws the same base seeds at the same moments; ``order`` draws what Keras's samplers
draw, with torch's own ``RandomSampler``. A call carries the driver's states to every
rank (``state``), each rank starts from them (``set_state``), so all ranks draw the
same order, and rank 0's states at the end go back to the driver: after the call its
generators are where plain Keras would have left them, and the next call, or the
user's own draws, continue from there.
"""

import random

import numpy as np
import torch


def state():
    """The host random states Keras's shuffles draw from, as plain bytes and tuples (a
    pickled tensor would travel to the worker processes through shared memory, holding a
    file descriptor open)."""
    return torch.get_rng_state().numpy().tobytes(), random.getstate()


def set_state(saved):
    torch.set_rng_state(torch.frombuffer(bytearray(saved[0]), dtype=torch.uint8))
    random.setstate(saved[1])


def order(n, batch_size, shuffle, batches=None):
    """The rows of one shuffled pass, in Keras's order.

    Args:
        n: rows (arrays), or None for a dataset of ``batches`` batches.
        batch_size: the global batch (arrays).
        shuffle: True or "batch".
        batches: a dataset's number of batches (``n`` None).

    Returns:
        an int array: arrays' rows, or a dataset's batch indices.
    """
    if n is None:  # PyDatasetAdapter._finite_generator
        indices = list(range(batches))
        random.shuffle(indices)
        return np.asarray(indices, dtype=np.int64)
    if shuffle == "batch":  # ArrayDataAdapter's RandomBatchSampler, batch by batch
        return np.concatenate([
            lo + torch.randperm(min(n, lo + batch_size) - lo).numpy()
            for lo in range(0, n, batch_size)]).astype(np.int64)
    return np.fromiter(iter(torch.utils.data.RandomSampler(range(n))), dtype=np.int64,
                       count=n)

"""shard="weights" in a pool: the state between your model and the ranks over their pipes
(``launch.state_pipe``), never through a file.

- The protocol in one process (a thread is the rank): a rank's ``Want`` is answered with
  the asked elements of your model's variables, received straight into its tensors; its
  ``Pieces`` land in your model's variables, a snapshot complete once every writer sent
  its part, ``partial`` when one did not.
- A fit on 2 simulated devices whose callback reads the weights at every epoch end: the
  pool's state file holds no state at the fit's start or at any epoch end (its allocated
  bytes stay under two pages per slot header), your model holds one device's weights at
  every epoch end and one device's optimizer state after the fit (its slots come back from
  the ranks over the pipes when read).
"""

import multiprocessing
import os
import threading
import warnings

import keras
import numpy as np
import pytest
import torch

import kmgpu
from kmgpu.engines.torch import replicas
from kmgpu.engines.torch.launch import state_pipe
from kmgpu.engines.torch.launch.messages import Pieces, Want
from tests.helpers import rel_diff
from tests.torch.shard_cases import BATCH, TOL, X, Y, opt_state, tiny


def _served(template, layout, rank_side):
    """Run ``rank_side(conn)`` in a thread as a rank, answering its messages with a
    ``DriverPipe`` of ``template`` until it closes its end."""
    driver_end, rank_end = multiprocessing.Pipe()
    pipe = state_pipe.DriverPipe(template, layout)
    thread = threading.Thread(target=lambda: (rank_side(rank_end), rank_end.close()))
    thread.start()
    while True:
        try:
            msg = driver_end.recv()
        except EOFError:
            break
        assert isinstance(msg, (Want, Pieces))
        pipe(driver_end, msg)
    thread.join()
    return pipe


def test_a_rank_receives_the_elements_it_asks_for_and_sends_its_pieces_into_your_model():
    model = tiny()
    model.compile(optimizer="adam", loss="mse")
    layout = replicas.layout_of(model, with_optimizer=True)
    variables = replicas.transfer_variables(model, layout)
    kernel = next(i for i, v in enumerate(variables) if tuple(v.shape) == (12, 5))
    want = torch.zeros(20)
    whole = np.zeros(tuple(variables[0].shape), "float32")

    def asks(conn):  # elements 10..30 of the Dense kernel, the embedding whole
        rank = state_pipe.RankPipe(conn, layout)
        rank._receive([(kernel, 10, 30, want),
                       (0, 0, whole.size, torch.from_numpy(whole.reshape(-1)))])

    _served(model, layout, asks)
    np.testing.assert_array_equal(want.numpy(), variables[kernel].numpy().reshape(-1)[10:30])
    np.testing.assert_array_equal(whole, variables[0].numpy())

    before = variables[kernel].numpy().copy()
    part = torch.arange(7, dtype=torch.float32)

    def sends(seq, writers):
        def side(conn):
            state_pipe.RankPipe(conn, layout).send([(kernel, 3, 10, part)], seq, 4, writers,
                                                   missing=(len(variables) - 2,))
        return side

    pipe = _served(model, layout, sends(1, 1))
    got = variables[kernel].numpy().reshape(-1)
    np.testing.assert_array_equal(got[3:10], part.numpy())
    np.testing.assert_array_equal(np.delete(got, range(3, 10)),
                                  np.delete(before.reshape(-1), range(3, 10)))
    assert pipe.complete == [(1, 4, (len(variables) - 2,))] and not pipe.partial

    pipe = _served(model, layout, sends(2, 2))  # one writer of two: not complete
    assert pipe.complete == [] and pipe.partial


FEATURES = 64
_X = np.random.default_rng(5).normal(size=(len(X), FEATURES)).astype("float32")


def wide():
    """Dense(256) 16,640 + Dense(1) 257 parameters: its state with Adam (203 KB) spans many
    pages of the state file."""
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(1)])


@pytest.fixture(scope="module")
def piped_fit():
    """One device's fit and a 2-device shard="weights" fit of ``wide``, 3 epochs, with a
    callback that reads the weights (and the state file's allocated bytes) at the fit's
    start and every epoch end."""
    plain = wide()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    class Weights(keras.callbacks.Callback):
        def __init__(self, parallel=None):
            super().__init__()
            self.parallel, self.epochs, self.file_bytes = parallel, [], []

        def _file(self):
            if self.parallel is not None:
                path = self.parallel._engine.launcher._state[0].path
                self.file_bytes.append(os.stat(path).st_blocks * 512)

        def on_train_begin(self, logs=None):
            self._file()

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(self.model.get_weights())
            self._file()

    seen = Weights()
    plain.fit(_X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[seen])
    plain_epochs = seen.epochs
    model = wide()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel = kmgpu.parallelize(model, gpus=2, shard="weights")
    parallel.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    watch = Weights(parallel)
    parallel.fit(_X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                 callbacks=[watch])
    return plain, plain_epochs, model, watch


def test_the_state_file_holds_no_state_at_any_point_of_a_sharded_fit(piped_fit):
    _, _, _, watch = piped_fit
    page = os.sysconf("SC_PAGE_SIZE")
    assert len(watch.file_bytes) == 4  # the fit's start, 3 epoch ends
    # the control page and the slots' header pages, where a snapshot of the weights
    # alone is 17 pages
    assert max(watch.file_bytes) <= 4 * page, watch.file_bytes


def test_your_model_holds_one_devices_state_at_every_epoch_end_and_after(piped_fit):
    plain, plain_epochs, model, watch = piped_fit
    assert len(watch.epochs) == 3
    for ours, theirs in zip(watch.epochs, plain_epochs):
        assert rel_diff(theirs, ours) < TOL
    assert rel_diff(plain.get_weights(), model.get_weights()) < TOL
    assert rel_diff(opt_state(plain), opt_state(model)) < TOL

"""TensorFlow: the distributed iterators a call leaves parked (data_fixes.park_iterators)
are dropped at the next call on a thread of their own, and that call does not wait for
the drop. TensorFlow's teardown of a MultiDeviceIterator now and then waits 0.2-20 s
(idle); done inside the next call, it stalled that call. Here the drop is held until
the call has returned: a call that waited for it would take the 30 s of the hold.
"""

import threading
import time

import numpy as np

import kmgpu
from tests.helpers import data, few_steps, mlp

HOLD_S = 30.0


def test_the_next_call_does_not_wait_for_the_last_calls_iterators(monkeypatch):
    from kmgpu.engines.tensorflow import data_fixes

    gate, dropped, drops = threading.Event(), threading.Event(), []
    real_drop = data_fixes._drop

    def held_drop(kept):  # TensorFlow's teardown at its slowest: it waits
        drops.append((len(kept), threading.current_thread().name))
        gate.wait(HOLD_S)
        real_drop(kept)
        dropped.set()

    monkeypatch.setattr(data_fixes, "_drop", held_drop)
    x, y = data("mlp", 48)
    model = mlp()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="sgd", loss="mse")
    with few_steps():
        parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)  # parks its iterator(s)
    start = time.monotonic()
    loss = parallel.evaluate(x, y, batch_size=16, verbose=0)  # hands them over
    took = time.monotonic() - start
    held = not dropped.is_set()
    gate.set()
    assert dropped.wait(HOLD_S), "the fit's iterators were never dropped"
    assert held and took < HOLD_S / 2, took  # evaluate returned while the drop waited
    assert drops[0][0] >= 1 and drops[0][1] == data_fixes.RELEASE_THREAD, drops
    assert np.isfinite(loss)

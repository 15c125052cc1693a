"""The script tests/*/test_launch.py start with ``kmgpu launch`` (or torchrun) on
2 "hosts" on 127.0.0.1: every process runs it with the same data and batch size.

It trains a small MLP for 2 epochs at global batch 16 with a ModelCheckpoint, and
writes ``$KMGPU_TEST_OUT/rank<r>.json``: replicas, the largest relative weight
difference to a one-process fit of the same model (computed here, before
kmgpu starts, without kmgpu), the losses, the checkpoint writes and what
``kmgpu.process_index()``, ``process_count()`` and ``is_main_process()`` say. With KMGPU_TEST_KILL set it then
writes its pid to ``pid<r>`` and keeps training until it is stopped.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import kmgpu  # noqa: E402
from tests.helpers import data, mlp, rel_diff, without_other_backends  # noqa: E402

without_other_backends()  # seeding would import it (5 s) only to seed it


def main():
    import keras

    from kmgpu import environment

    out = os.environ["KMGPU_TEST_OUT"]
    rank = environment.process_index()
    x, y = data("mlp", 64)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref_hist = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    model = mlp()
    parallel = kmgpu.parallelize(model)
    parallel.compile(optimizer="adam", loss="mse")
    writes = []

    class Checkpoint(keras.callbacks.ModelCheckpoint):  # counts its writes in this process
        def _save_model(self, epoch, batch, logs):
            writes.append(epoch)
            super()._save_model(epoch, batch, logs)

    ckpt = Checkpoint(os.path.join(out, "ckpt.weights.h5"), save_weights_only=True)
    hist = parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[ckpt])
    pred = parallel.predict(x, batch_size=16, verbose=0)
    parallel.save(os.path.join(out, "model.keras"))
    result = {
        "rank": rank,
        "replicas": parallel.num_replicas,
        "engine": parallel._engine.name,
        "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
        "loss": hist.history["loss"],
        "ref_loss": ref_hist.history["loss"],
        "pred_rows": int(pred.shape[0]),
        "pred_err": float(np.max(np.abs(pred - ref.predict(x, batch_size=16, verbose=0)))),
        "checkpoint_writes": writes,
        # the public helpers, as the user's own code reads them in this job
        "helpers": [kmgpu.process_index(), kmgpu.process_count(), kmgpu.is_main_process()],
    }
    if keras.backend.backend() == "tensorflow":
        result["sources"] = python_sources()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if os.environ.get("KMGPU_TEST_KILL"):  # keep training until a process is killed
        with open(os.path.join(out, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        while True:
            parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)
    parallel.close()


def python_sources():
    """TensorFlow: a model with an own loss (a mean over rows, 0 on one row) fitted 1
    epoch on a generator (78 rows in batches of 8: split 4 + 4, and 3 + 3), then on a
    generator of 75 rows whose last batch of 3 splits 2 + 1 (the layer that adds the loss
    runs on the global batch: ``engines/global_losses``). A PyDataset and a DataLoader
    take the same per-replica feed (tests/tensorflow/test_checked_sources: one worker).
    Returns the relative weight difference from the same fits in one process after each
    fit."""
    from tests.common.test_every_batch import _loss_model, _xy

    x, y = _xy()
    reference, model = _loss_model(), _loss_model()
    parallel = kmgpu.parallelize(model)
    for fit in (reference.fit, parallel.fit):
        fit(((x[s:s + 8], y[s:s + 8]) for s in range(0, 78, 8)), epochs=1, verbose=0)
    found = {"first fit": rel_diff(reference.get_weights(), model.get_weights())}
    for fit in (reference.fit, parallel.fit):
        fit(((x[s:min(s + 8, 75)], y[s:min(s + 8, 75)]) for s in range(0, 75, 8)),
            epochs=1, verbose=0)
    found["second fit"] = rel_diff(reference.get_weights(), model.get_weights())
    return found


if __name__ == "__main__":
    main()

"""What tests/common/test_launch_checkpoints.py starts with ``kmgpu launch`` on 2 "hosts"
x 1 process: Keras's checkpoint callbacks in a job of several processes, under every
``shard`` value the backend takes.

``KMGPU_TEST_PHASE=save``: for each ``shard`` value, a 2-epoch fit with
``ModelCheckpoint`` (weights only, and whole ``.keras`` files, one per epoch),
``BackupAndRestore`` keeping its backup (``delete_checkpoint=False``: what a job killed
after epoch 2 leaves) and ``kmgpu.ShardedCheckpoint``. ``KMGPU_TEST_PHASE=resume``: a new
job, for each ``shard`` value a fresh model fitted for 3 epochs with the same
``BackupAndRestore``, which resumes after epoch 2, and another with the same
``ShardedCheckpoint``. Each process writes ``$KMGPU_TEST_OUT/<phase><r>.json``: per
``shard`` value (``sharded-<shard>``: the resume from ``ShardedCheckpoint``) the History
and the largest relative difference of its model's weights to a one-process fit (made
here before kmgpu starts).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kmgpu  # noqa: E402
from tests.helpers import data, mlp, rel_diff, shard_values, without_other_backends  # noqa: E402

ROWS, BATCH = 64, 16


def reference(epochs):
    """The one-process model after ``epochs`` epochs, and its History."""
    x, y = data("mlp", ROWS)
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def callbacks(out, shard, phase):
    """The fits' callbacks: {name: list}."""
    import keras

    where = os.path.join(out, str(shard))
    backup = keras.callbacks.BackupAndRestore(os.path.join(where, "backup"),
                                              delete_checkpoint=False)
    sharded = kmgpu.ShardedCheckpoint(os.path.join(where, "sharded"))
    if phase == "resume":
        return {str(shard): [backup], f"sharded-{shard}": [sharded]}
    return {str(shard): [
        keras.callbacks.ModelCheckpoint(os.path.join(where, "ep{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint(os.path.join(where, "ep{epoch}.keras")),
        backup, sharded]}


def main():
    import keras

    from kmgpu import environment

    if keras.backend.backend() != "tensorflow":
        without_other_backends()  # seeding would import it (5 s) only to seed it
    out, phase = os.environ["KMGPU_TEST_OUT"], os.environ["KMGPU_TEST_PHASE"]
    epochs = 3 if phase == "resume" else 2
    ref, ref_history = reference(epochs)
    x, y = data("mlp", ROWS)
    found = {}
    runs = [(name, shard, fit_callbacks) for shard in shard_values()
            for name, fit_callbacks in callbacks(out, shard, phase).items()]
    for name, shard, fit_callbacks in runs:
        model = mlp()
        parallel = kmgpu.parallelize(model, shard=shard)
        parallel.compile(optimizer="adam", loss="mse")
        history = parallel.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                               verbose=0, callbacks=fit_callbacks)
        found[name] = {"epoch": history.epoch, "loss": history.history["loss"],
                       "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
                       "replicas": parallel.num_replicas}
    result = {"rank": environment.process_index(), "ref_loss": ref_history["loss"],
              "shards": found}
    with open(os.path.join(out, f"{phase}{environment.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

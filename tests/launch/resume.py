"""What tests/common/test_resume.py runs in processes of its own: ``BackupAndRestore`` and
``kmgpu.ShardedCheckpoint`` of a process that is killed, resumed by a new process on the
same or another device count.

``python resume.py kill N OUT``: on N simulated devices, for each ``shard`` value the
backend takes and each of the two callbacks, a 3-epoch fit with the callback saving in
``OUT/<callback>-<shard>`` that stops at the start of epoch 3 (raising: the checkpoint on
disk is what a kill then leaves); then the process kills itself (SIGKILL). ``python
resume.py resume N OUT``: on N devices, for each, a fresh model's 3-epoch fit with the
same callback, which resumes after epoch 2; writes ``OUT/resume<N>.json``: per
callback and ``shard`` value the History and the largest relative difference of the
weights to a 3-epoch one-device fit made here.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kmgpu  # noqa: E402

ROWS, BATCH, EPOCHS = 32, 8, 3  # 4 steps an epoch: a tiny fit


def main(phase, n, out):
    kmgpu.simulate_devices(n)
    import keras

    from tests.helpers import data, mlp, rel_diff, shard_values

    x, y = data("mlp", ROWS)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref_history = ref.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)

    class Stop(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("stopped before epoch 3")

    callbacks = {"backup": keras.callbacks.BackupAndRestore, "sharded": kmgpu.ShardedCheckpoint}
    found = {}
    for (name, callback), shard in [(c, s) for c in callbacks.items() for s in shard_values()]:
        model = mlp()
        parallel = kmgpu.parallelize(model, shard=shard)
        parallel.compile(optimizer="adam", loss="mse")
        backup = callback(os.path.join(out, f"{name}-{shard}"))
        fit = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        if phase == "kill":
            try:
                parallel.fit(x, y, callbacks=[backup, Stop()], **fit)
            except RuntimeError as e:
                assert "stopped before epoch 3" in str(e), e
            continue
        history = parallel.fit(x, y, callbacks=[backup], **fit)
        found[f"{name}-{shard}"] = {"epoch": history.epoch, "loss": history.history["loss"],
                             "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
                             "replicas": parallel.num_replicas}
    if phase == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(out, f"resume{n}.json"), "w") as f:
        json.dump({"ref_loss": ref_history.history["loss"], "shards": found}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

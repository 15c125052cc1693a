"""What tests/common/test_resume.py runs in processes of its own: ``BackupAndRestore`` of a
process that is killed, resumed by a new process on the same or another device count.

``python resume.py kill N OUT``: on N simulated devices, for each ``shard`` value the
backend takes, a 3-epoch fit with ``BackupAndRestore(OUT/<shard>)`` that stops at the
start of epoch 3 (raising: the backup on disk is what a kill then leaves); then the
process kills itself (SIGKILL). ``python resume.py resume N OUT``: on N devices, for
each ``shard`` value, a fresh model's 3-epoch fit with the same ``BackupAndRestore``,
which resumes after epoch 2; writes ``OUT/resume<N>.json``: per ``shard`` value the
History and the largest relative difference of the weights to a 3-epoch one-device
fit made here.
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

    found = {}
    for shard in shard_values():
        model = mlp()
        parallel = kmgpu.parallelize(model, shard=shard)
        parallel.compile(optimizer="adam", loss="mse")
        backup = keras.callbacks.BackupAndRestore(os.path.join(out, str(shard)))
        fit = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        if phase == "kill":
            try:
                parallel.fit(x, y, callbacks=[backup, Stop()], **fit)
            except RuntimeError as e:
                assert "stopped before epoch 3" in str(e), e
            continue
        history = parallel.fit(x, y, callbacks=[backup], **fit)
        found[str(shard)] = {"epoch": history.epoch, "loss": history.history["loss"],
                             "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
                             "replicas": parallel.num_replicas}
    if phase == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(out, f"resume{n}.json"), "w") as f:
        json.dump({"ref_loss": ref_history.history["loss"], "shards": found}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

"""What tests/torch/test_restart.py starts with ``kmgpu launch --nproc-per-node 2
--max-restarts 1``: torchrun's restarts resuming a fit with ``BackupAndRestore``.

A 4-epoch fit (global batch 16, no shuffling) with ``BackupAndRestore`` and a
``CSVLogger(append=True)``; in torchrun's first attempt, process 0 kills itself when
epoch 2 (index 2) begins, after the backup of epoch 1 is written. torchrun stops the
other process and starts both again; the backup resumes the fit at epoch 2. Process 0
then writes ``$KMGPU_TEST_OUT/restart.json``: the largest relative difference of its
weights to an uninterrupted one-process fit, that fit's losses, the CSV's epochs and
losses, the resumed fit's History, and torchrun's attempt.
"""

import csv
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import kmgpu  # noqa: E402
from tests.helpers import data, mlp, rel_diff, without_other_backends  # noqa: E402

without_other_backends()  # seeding would import it (5 s) only to seed it
EPOCHS, BATCH = 4, 16


def main():
    import keras

    out = os.environ["KMGPU_TEST_OUT"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x, y = data("mlp", 64)
    model = mlp()
    parallel = kmgpu.parallelize(model)
    parallel.compile(optimizer="adam", loss="mse")

    def die_once(epoch, logs):
        if epoch == 2 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    history = parallel.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
                   keras.callbacks.CSVLogger(os.path.join(out, "log.csv"), append=True),
                   keras.callbacks.LambdaCallback(on_epoch_begin=die_once)])
    if not kmgpu.is_main_process():
        return
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref_history = ref.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    with open(os.path.join(out, "log.csv")) as f:
        rows = list(csv.DictReader(f))
    result = {"attempt": attempt, "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
              "ref_loss": ref_history.history["loss"],
              "csv_epochs": [int(r["epoch"]) for r in rows],
              "csv_loss": [float(r["loss"]) for r in rows],
              "epochs": history.epoch, "loss": history.history["loss"]}
    with open(os.path.join(out, "restart.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

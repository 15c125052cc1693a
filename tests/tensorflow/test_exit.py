"""TensorFlow: a script that ends after a kmgpu fit exits at once.

Each replica's pipeline of a ``MultiDeviceIterator`` (what tf.distribute feeds a replica
from) had tf.data's autotuning on; its autotune thread sleeps between rounds (10 ms,
30 ms, ... 5.11 s, 10.23 s after the first batch, doubling up to 60 s), and destroying
the iterator waited out that sleep (data_fixes.untuned_iterators). The script
below ends 5.3 s after its fit's first batch, so a destruction that waits takes 4.9 s or
more: before the fix, 5 of 6 such runs took 6-78 s from their last line to their exit;
after it, 1.4-1.5 s on an idle machine.
"""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_S = 4.5  # from the script's last line to the end of its process
PHASE_S = 5.3  # the script's last line, after its fit's first batch

SCRIPT = f"""
import time

import keras
import numpy as np

import kmgpu

kmgpu.simulate_devices(4)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
parallel = kmgpu.parallelize(model, gpus=4)
parallel.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).random((64, 5), dtype="float32")
y = x.sum(1, keepdims=True)
first = []
read = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda *_, **__: first.append(time.monotonic()))
history = parallel.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[read],
                       validation_data=(x, y))
time.sleep(max(0.0, first[0] + {PHASE_S} - time.monotonic()))
print("steps", len(first), "val_loss", history.history["val_loss"][-1])
print("last line", time.time(), flush=True)
"""


def test_a_script_exits_at_once_after_its_fit():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT,
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    ended = time.time()
    assert proc.returncode == 0, err[-3000:]
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["steps"].split()[0] == "4", out  # 64 rows in batches of 16
    exit_s = ended - float(lines["last"].split()[-1])
    assert exit_s < EXIT_S, f"the process took {exit_s:.1f} s to exit after its last line"

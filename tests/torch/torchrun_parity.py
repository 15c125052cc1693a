"""kmgpu's in-process mode under torchrun, what tests/torch/test_launch.py starts with
``kmgpu launch`` on 2 "hosts" x 2 processes (torchrun on each):

Every process runs this same script with the same data (the multi-process contract):
kmgpu sees torchrun's environment, makes this process one gloo rank, and trains a
conv + BatchNorm model (sync_batchnorm) with DDP in-process. Every rank but 0 starts
from other weights: kmgpu broadcasts rank 0's. Each rank writes its results to
``$KMGPU_TEST_OUT/torchrun<r>.json``, then runs tests/launch/train.py (the parity and
kill test every backend's launch runs) in the same process group, so one launch serves
both tests.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import kmgpu  # noqa: E402
from tests.helpers import MODELS, data, rel_diff, without_other_backends  # noqa: E402

without_other_backends()  # seeding would import it (5 s) only to seed it


def main():
    import keras
    import torch.distributed as dist

    kind = "conv_bn"
    x, y = data(kind, 97)
    ref = MODELS[kind]()
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
    ref_hist = ref.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)

    model = MODELS[kind]()
    rank = int(os.environ["RANK"])
    if rank != 0:  # a different start: kmgpu must broadcast rank 0's weights
        model.set_weights([w + 0.5 for w in model.get_weights()])
    seen = []
    callback = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(e))
    parallel = kmgpu.parallelize(model, sync_batchnorm=True)
    parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
    hist = parallel.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0,
                        callbacks=[callback])
    pred = parallel.predict(x, batch_size=20, verbose=0)
    got = parallel.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    want = ref.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
    result = {
        "rank": dist.get_rank(),
        "replicas": parallel.num_replicas,
        "engine": parallel._engine.name,
        "rel_diff": rel_diff(ref.get_weights(), model.get_weights()),
        "loss": hist.history["loss"],
        "ref_loss": ref_hist.history["loss"],
        "pred_rows": int(pred.shape[0]),
        "pred_err": float(np.max(np.abs(pred - ref.predict(x, batch_size=20, verbose=0)))),
        "eval": got,
        "ref_eval": want,
        "callback_epochs": seen,
        "stateful": _stateful_carry(),
    }
    with open(os.path.join(os.environ["KMGPU_TEST_OUT"], f"torchrun{rank}.json"), "w") as f:
        json.dump(result, f)


def _stateful_carry():
    """A stateful LSTM: each rank keeps its rows of the state; they come back to every
    rank's model in rank order. Returns (last chunk vs stateless, state rows) errors."""
    import keras

    from kmgpu.engines import replication
    from tests.common.test_stateful import B, CHUNK, CHUNKS, chunked, make, sequences

    seqs, state = sequences(), lambda m: keras.ops.convert_to_numpy(
        replication.state_variables(m)[0].value)
    whole = make("LSTM", batch=None, steps=CHUNK * CHUNKS, is_stateful=False)
    model, direct = make("LSTM"), make("LSTM")
    model.set_weights(whole.get_weights())
    direct.set_weights(whole.get_weights())
    out = kmgpu.parallelize(model).predict(chunked(seqs), batch_size=B, verbose=0)
    for k in range(CHUNKS):
        direct(chunked(seqs)[k * B:(k + 1) * B])
    return [float(np.abs(out[-B:] - whole.predict(seqs, verbose=0)).max()),
            float(np.abs(state(model) - state(direct)).max())]


if __name__ == "__main__":
    main()
    from tests.launch import train

    train.main()

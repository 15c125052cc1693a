"""Real-GPU check of the torch engine (run by hand on a CUDA machine, not by pytest).

    KERAS_BACKEND=torch python tests/torch/gpu_check.py [out.json]

One GPU, NCCL, world size 1: kmgpu's pool worker trains the model; it must match a
plain ``model.fit`` on the same GPU, and this prints samples/s of both.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402


def build(seed=3, width=2048):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((512,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])


def main(out_path=None):
    import keras
    import torch

    import kmgpu
    from tests.helpers import rel_diff

    report = {"torch": torch.__version__, "keras": keras.__version__,
              "gpu": torch.cuda.get_device_name(0), "devices": kmgpu.devices()}
    rng = np.random.default_rng(0)
    n, batch, epochs = 65536, 1024, 3
    x = rng.normal(size=(n, 512)).astype("float32")
    y = rng.normal(size=(n, 10)).astype("float32")

    # parity: a short fit, same initial weights, shuffle=False
    ref = build()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x[:8192], y[:8192], batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model = build()
    parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(optimizer="adam", loss="mse")
    t = time.perf_counter()
    parallel.fit(x[:8192], y[:8192], batch_size=batch, epochs=2, shuffle=False, verbose=0)
    report["first_call_s (pool start + fit)"] = time.perf_counter() - t
    report["engine"] = parallel._engine.name
    report["start_method"] = parallel._engine.launcher.pool.method
    report["parity_rel_diff"] = rel_diff(ref.get_weights(), model.get_weights())
    pred = parallel.predict(x[:4096], batch_size=batch, verbose=0)
    report["predict_max_abs_diff"] = float(np.max(np.abs(pred - ref.predict(
        x[:4096], batch_size=batch, verbose=0))))

    # throughput: epochs after a warm-up epoch, same data, same batch
    def timed(fit):
        fit(1)
        t = time.perf_counter()
        fit(epochs)
        return n * epochs / (time.perf_counter() - t)

    plain = build()
    plain.compile(optimizer="adam", loss="mse")
    report["plain_samples_per_s"] = timed(
        lambda e: plain.fit(x, y, batch_size=batch, epochs=e, verbose=0))
    report["kmgpu_samples_per_s"] = timed(
        lambda e: parallel.fit(x, y, batch_size=batch, epochs=e, verbose=0))
    report["kmgpu/plain"] = report["kmgpu_samples_per_s"] / report["plain_samples_per_s"]
    report["plain_no_shuffle_samples_per_s"] = timed(
        lambda e: plain.fit(x, y, batch_size=batch, epochs=e, shuffle=False, verbose=0))
    report["kmgpu_no_shuffle_samples_per_s"] = timed(
        lambda e: parallel.fit(x, y, batch_size=batch, epochs=e, shuffle=False, verbose=0))
    parallel.close()

    # where the difference goes: the rank's own path in this process (NCCL, world 1)
    import torch.distributed as dist

    from kmgpu.engines.base import Config
    from kmgpu.engines.torch import strategy
    from kmgpu.engines.torch.data import inputs

    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                          wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    ddp = strategy.DDPStrategy("cuda:0", Config())
    rank_model = build()
    rank_model.compile(optimizer="adam", loss="mse")
    ddp.prepare(rank_model)
    report["rank_path_samples_per_s"] = timed(lambda e: ddp.run(
        rank_model, "fit", dict(x=x, y=y, batch_size=batch, epochs=e, verbose=0)))
    slices = inputs.RankSlices(inputs.ArraySource(x, y), batch, ddp.rank, ddp.world, shuffle=True)
    report["plain_on_rank_slices_samples_per_s"] = timed(
        lambda e: plain.fit(slices, epochs=e, shuffle=False, verbose=0))
    dist.destroy_process_group()
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)

"""What tests/jax/test_launch.py starts with ``kmgpu launch`` on 2 "hosts" x 1 process:
an Adam fit with ``shard_optimizer=True`` (the slots' shards on different processes) and
one with ``shard="weights"`` (the weights' shards too), then ``$KMGPU_TEST_OUT/zero<r>.json``
with the largest relative difference of the weights and of the optimizer variables to a
one-process fit, and this process's optimizer bytes (weight bytes for the second);
then tests/launch/train.py (the parity and kill test every backend's launch runs), so one
launch serves both tests.
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
    from kmgpu import environment
    from kmgpu.engines import replication
    from kmgpu.engines.jax import zero

    x, y = data("mlp", 64)
    ref = mlp()
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = mlp()
    parallel = kmgpu.parallelize(model, shard_optimizer=True)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    state = replication.optimizer_state(parallel._engine.replica.optimizer)
    result = {
        "replicas": parallel.num_replicas,
        "weights": rel_diff(ref.get_weights(), model.get_weights()),
        "optimizer": rel_diff([np.asarray(v) for v in ref.optimizer.variables],
                              [np.asarray(v) for v in model.optimizer.variables]),
        "bytes": zero.measured_bytes(state),
        "planned": zero.planned_bytes(state, parallel.num_replicas),
    }
    parallel.close()
    # shard="weights": the weights too, each process holding its half; the same reference
    model = mlp()
    parallel = kmgpu.parallelize(model, shard="weights")
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights = replication.weights(parallel._engine.replica)
    result["fsdp"] = {
        "weights": rel_diff(ref.get_weights(), model.get_weights()),
        "optimizer": rel_diff([np.asarray(v) for v in ref.optimizer.variables],
                              [np.asarray(v) for v in model.optimizer.variables]),
        "bytes": zero.measured_bytes(weights),
        "planned": zero.planned_bytes(weights, parallel.num_replicas, zero.shards_weight),
        "predict": rel_diff([ref.predict(x, verbose=0)], [parallel.predict(x, verbose=0)]),
    }
    parallel.close()
    with open(os.path.join(os.environ["KMGPU_TEST_OUT"],
                           f"zero{environment.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    from tests.launch import train

    train.main()

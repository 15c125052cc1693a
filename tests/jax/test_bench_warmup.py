"""``kmgpu bench`` times each run after its own warm-up: one untimed epoch
through the same fit, then the weights and optimizer state as they were, so the timed
run trains exactly as a fit without warm-up would."""

import numpy as np

from tests.helpers import rel_diff


def test_warm_up_leaves_the_run_as_without_it():
    import dataclasses

    from kmgpu.bench import runners, workloads

    w = dataclasses.replace(workloads.get("lstm", quick=True, epochs=1, steps=3), batch=4,
                            args=(("steps", 2), ("width", 4)), input_shape=(2, 16))
    result = runners.run("replay", w, 1)  # plain fit, after its warm-up
    assert result["warmup_s"] > 0
    assert len(result["epoch_seconds"]) == 1
    model = w.build()
    model.compile(**runners.compile_args(w))
    x, y = w.data()
    history = model.fit(x, y, batch_size=w.batch, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(model.get_weights(), result["weights"]) == 0.0
    np.testing.assert_allclose(result["loss"], history.history["loss"][-1], rtol=1e-6)

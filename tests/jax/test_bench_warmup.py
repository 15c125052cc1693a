"""``kmgpu bench`` times each run after its own warm-up: one untimed epoch
through the same fit, then the weights and optimizer state as they were, so the timed
run trains exactly as a fit without warm-up would."""

import numpy as np
import pytest

from tests.helpers import rel_diff


def _tiny_lstm(epochs, steps, **changes):
    """The bench's lstm workload at a few dozen weights: batch 4, 2 timesteps, width 4."""
    import dataclasses

    from kmgpu.bench import workloads

    return dataclasses.replace(workloads.get("lstm", quick=True, epochs=epochs, steps=steps),
                               batch=4, args=(("steps", 2), ("width", 4)), input_shape=(2, 16),
                               **changes)


def test_warm_up_leaves_the_run_as_without_it():
    from kmgpu.bench import runners

    w = _tiny_lstm(1, 3)
    result = runners.run("replay", w, 1)  # plain fit, after its warm-up
    assert result["warmup_s"] > 0
    assert len(result["epoch_seconds"]) == 1
    model = w.build()
    model.compile(**runners.compile_args(w))
    x, y = w.data()
    history = model.fit(x, y, batch_size=w.batch, epochs=1, shuffle=False, verbose=0)
    assert rel_diff(model.get_weights(), result["weights"]) == 0.0
    np.testing.assert_allclose(result["loss"], history.history["loss"][-1], rtol=1e-6)


def test_warm_up_ends_when_two_epochs_agree_after_running_long_enough():
    from kmgpu.bench import runners

    assert not runners.steady([20.0]) and not runners.steady([20.0, 0.3])  # a compile
    assert runners.steady([20.0, 0.30, 0.32]) and not runners.steady([0.30, 0.40])
    short, long_ = runners.WARMUP_MIN_S / 2, runners.WARMUP_MIN_S + 0.5
    assert not runners.warm([20.0, 0.30, 0.32], short)  # agree, but not run long enough
    assert runners.warm([20.0, 0.30, 0.32], long_)
    assert not runners.warm([20.0, 0.30, 0.40], long_)  # long enough, not steady
    assert runners.warm([20.0, 0.3, 0.4, 0.5][:runners.WARMUP_EPOCHS_MAX], long_)  # the cap
    assert not runners.warm([20.0, 0.3, 0.4, 0.5], short)  # the cap waits for the minimum
    assert runners.warm([20.0, 0.30, 0.40], runners.WARMUP_MAX_S)
    # the replay of a model already warm in the process: two epochs that agree suffice
    assert runners.warm([20.0, 0.30, 0.32], 0.0, minimum=0.0)
    assert not runners.warm([20.0, 0.30, 0.40], 0.0, minimum=0.0)


@pytest.mark.filterwarnings("ignore:kmgpu. only")  # few steps per epoch, as the bench's
def test_evaluate_and_predict_on_the_same_few_batches_for_every_runner(monkeypatch):
    """Full-size rules on a tiny model: the warm-up until steady, evaluate and predict on
    the first INFER_BATCHES batches for plain fit and kmgpu alike, none for the replay."""
    from kmgpu.bench import runners

    # no minimum run time: a GPU's clocks are not what a CPU suite checks (``warm`` has its
    # own test), and the warm-up costs what it did before the minimum
    monkeypatch.setattr(runners, "WARMUP_MIN_S", 0.0)

    w = _tiny_lstm(2, 5, quick=False)
    plain, kmgpu = runners.run("plain", w, 1), runners.run("kmgpu", w, 1)
    for result in (plain, kmgpu):
        assert result["infer_samples"] == runners.INFER_BATCHES * w.batch
        assert result["evaluate_s"] > 0 and result["predict_s"] > 0
        assert result["warmup_s"] > 0 and len(result["epoch_seconds"]) == 2
        # where the warm-up's and the first calls' seconds went, for sizing the budget
        calls, epochs = result["warmup_calls_s"], result["warmup_epochs_s"]
        assert len(calls) >= 1 and len(epochs) >= 2 and sum(calls) <= result["warmup_s"]
        assert sum(epochs) <= sum(calls)
        assert result["evaluate_first_s"] > 0 and result["predict_first_s"] > 0
        # what the host did in each timed epoch: the dispatching thread's CPU seconds
        # within the epoch's wall time, the process's at least as many
        host = result["host"]
        assert all(len(v) == 2 for v in host.values())
        for cpu, process, wall in zip(host["thread_cpu_s"], host["process_cpu_s"],
                                      result["epoch_seconds"]):
            assert 0 < cpu <= wall * 1.05 + 0.01 and process >= cpu - 1e-3
        assert all(isinstance(n, int) and n >= 0 for n in host["preemptions"])
        assert all(s is not None and s >= 0 for s in host["steal_s"])  # Linux
    assert "predict_s" not in runners.run("replay", w, 1)


def test_the_replay_fits_the_plain_runs_model_again_from_the_same_start(monkeypatch):
    """In the process of the plain fit, the replay takes its model (no build, no compile,
    no settling time): weights and optimizer state back at the start, it trains to the
    plain run's weights."""
    from kmgpu.bench import runners, workloads

    w = _tiny_lstm(1, 3)
    minimums, warm_up = [], runners._warm_up
    monkeypatch.setattr(runners, "_warm_up", lambda *a, **k: minimums.append(
        k.get("minimum_s")) or warm_up(*a, **k))
    plain = runners.run("plain", w, 1)
    builds, build = [], workloads.Workload.build
    monkeypatch.setattr(workloads.Workload, "build",
                        lambda self: builds.append(self.name) or build(self))
    replay = runners.run("replay", w, 1)
    assert builds == []
    assert minimums == [None, 0.0]  # the replay's model is warm: no settling minimum
    assert rel_diff(plain["weights"], replay["weights"]) == 0.0
    np.testing.assert_allclose(replay["loss"], plain["loss"], rtol=1e-6)
    runners.run("replay", w, 1)  # no plain model waits any more: a model of its own
    assert builds == ["lstm"]

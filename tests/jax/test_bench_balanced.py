"""``kmgpu bench``'s comparison table (issues 29, 30): kmgpu's overhead against plain fit
is order-balanced where plain fit ran again after kmgpu (plain, kmgpu, plain), marked
unbalanced where it did not, every target marked met or missed (simulated devices
included), and the columns defined where they are printed."""

from kmgpu.bench import report


def _results(replay, simulate=2):
    def run(runner, sps):
        return {"backend": "jax", "workload": "cnn32", "runner": runner, "devices": 1,
                "policy": "global", "status": "ok", "samples_per_s": sps}

    runs = [run("plain", 3600.0), run("kmgpu", 3500.0)]
    if replay:
        runs.append(run("replay", 3400.0))
    return {"name": "t", "simulate": simulate, "machine": {"gpus": []}, "runs": runs}


def test_overhead_is_against_plain_before_and_after_kmgpu():
    row = report.comparison_rows(_results(replay=True))[0]
    assert row["overhead"] == 0.0 and row["balanced"]  # mean(3600, 3400) / 3500 - 1
    assert abs(row["noise"] - (3600 / 3400 - 1)) < 1e-12
    assert "| +0.0% met |" in report.comparison_table(_results(replay=True))


def test_without_plain_again_the_overhead_says_unbalanced_and_is_still_marked():
    table = report.comparison_table(_results(replay=False))
    assert "| +2.9% **missed** (unbalanced) |" in table  # 3600 / 3500 - 1, on simulated devices


def test_the_report_defines_overhead_noise_efficiency_and_parity():
    text = report.markdown(dict(_results(replay=True), workloads={}))
    for words in ("overhead: how much longer kmgpu on 1 device takes", "noise: plain fit against",
                  "efficiency: speedup / N (it can exceed 1", "parity: the largest relative"):
        assert words in text, words

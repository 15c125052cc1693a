"""``kmgpu bench``'s comparison table: kmgpu against plain fit as a ratio, order-balanced
where plain fit ran again after kmgpu (plain, kmgpu, plain), marked unbalanced where it
did not; every target marked met or missed (simulated devices included) unless the row's
own noise (plain fit against plain fit again) is over 5%, then 'not judged'; the peer's
columns only where a peer ran; the columns defined where they are printed."""

from kmgpu.bench import report, summary


def _results(replay, simulate=2, again=3400.0, peer=False):
    def run(runner, sps, n=1):
        return {"backend": "jax", "workload": "cnn32", "runner": runner, "devices": n,
                "policy": "global", "status": "ok", "samples_per_s": sps}

    runs = [run("plain", 3600.0), run("kmgpu", 3500.0)]
    if replay:
        runs.append(run("replay", again))
    if peer:
        runs += [run("kmgpu", 6000.0, 2), run("peer", 5000.0, 2)]
    return {"name": "t", "simulate": simulate, "machine": {"gpus": []}, "runs": runs}


def test_kmgpu_against_plain_before_and_after_it_as_a_ratio():
    row = report.comparison_rows(_results(replay=True))[0]
    assert row["vs_plain"] == 1.0 and row["balanced"]  # 3500 / mean(3600, 3400)
    assert abs(row["noise"] - (3600 / 3400 - 1)) < 1e-12 and row["noisy"]  # 5.9%
    table = report.comparison_table(_results(replay=True))
    assert "| 1.00x not judged (noise over 5%) | 5.9% (over 5%) |" in table
    table = report.comparison_table(_results(replay=True, again=3550.0))
    assert "| 0.98x **missed** | 1.4% |" in table  # 3500 / 3575, inside 5%: judged
    assert "%" not in table.split("\n")[2].split("|")[7]  # the ratio is no percentage


def test_without_plain_again_the_ratio_says_unbalanced_and_is_still_marked():
    table = report.comparison_table(_results(replay=False))
    assert "| 0.97x **missed** (unbalanced) | - |" in table  # 3500 / 3600, simulated devices


def test_the_peer_columns_only_where_a_peer_ran():
    alone = report.comparison_table(_results(replay=True))
    assert "peer" not in alone
    both = report.comparison_table(_results(replay=True, peer=True))
    head = both.splitlines()[0]
    assert "| peer |" in head and "kmgpu / peer (target >= 1.00x)" in head
    assert "| 1.20x met |" in both  # 6000 / 5000 at N = 2
    assert "| 1.71x | 5.9% (over 5%) | 1.20x met |" in both  # N = 2: the speed-up, no target


def test_the_leading_table_flags_a_noisy_row():
    text = summary.table(_results(replay=True))
    row = next(line for line in text.splitlines() if line.startswith("| cnn32 | jax |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:6] == ["3,500", "3,500", "1.00x, not judged", "5.9% (over 5%)"]


def test_the_report_defines_the_ratio_noise_efficiency_and_parity():
    text = report.markdown(dict(_results(replay=True), workloads={}))
    for words in ("kmgpu / plain fit: kmgpu's samples/s over", "plain vs plain again (noise)",
                  "efficiency: speedup / N (it can exceed 1", "parity: the largest relative"):
        assert words in text, words


def _with_host(results, plain, again):
    """Each plain run's epochs and what the host did in them: (wall s, thread CPU s)."""
    for r in results["runs"]:
        if r["runner"] in ("plain", "replay"):
            wall, cpu = plain if r["runner"] == "plain" else again
            r["epoch_seconds"] = [wall] * 3
            r["host"] = {"thread_cpu_s": [cpu] * 3, "process_cpu_s": [cpu * 1.5] * 3,
                         "preemptions": [2, 0, 1], "steal_s": [0.0, 0.01, None]}
    return results


def test_a_row_not_judged_says_whether_the_host_ran_slower_or_waited():
    """A noisy row's note tells a slower CPU (the dispatching thread's CPU seconds grew
    with the wall time) from waiting (the same CPU seconds); a judged row has none."""
    slower = _with_host(_results(replay=True), (1.0, 0.9), (0.944, 0.85))
    notes = summary.noise_notes(slower)
    assert len(notes) == 1 and notes[0].startswith("- cnn32 on jax, not judged:")
    assert "+5.9%" in notes[0] and "the difference was on the CPU" in notes[0]
    assert "preempted 3 against 3 times, machine steal 0.01 s against 0.01 s" in notes[0]
    waited = _with_host(_results(replay=True), (1.0, 0.5), (0.944, 0.5))
    assert "the difference was off the CPU" in summary.noise_notes(waited)[0]
    assert "from what the host did" in report.markdown(dict(waited, workloads={}))
    judged = _with_host(_results(replay=True, again=3550.0), (1.0, 0.9), (0.99, 0.85))
    assert summary.noise_notes(judged) == []  # 1.4%: inside the limit
    assert summary.noise_notes(_results(replay=True)) == []  # older records: no host

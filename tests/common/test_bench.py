"""``kmgpu bench``: the --quick smoke run (as CI runs it), the report, skipped backends.

The quick run is split over the backend sessions of scripts/test.sh, one workload
each, so the suite runs every backend and every workload once:
tensorflow -> sine, jax -> lstm, torch -> cnn32 (all runners, 1 and 2 devices).
"""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK_WORKLOAD = {"tensorflow": "sine", "jax": "lstm", "torch": "cnn32"}


def _benchmarks():
    from kmgpu import bench

    bench._benchmarks()
    import benchmarks.main
    import benchmarks.report

    return benchmarks


def test_quick_bench_smoke(tmp_path):
    import keras

    backend = keras.config.backend()
    workload = QUICK_WORKLOAD[backend]
    env = {k: v for k, v in os.environ.items()
           if k not in ("KMGPU_SIMULATE_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kmgpu", "bench", "--quick", "--backends", backend,
         "--workloads", workload, "--out", str(tmp_path), "--name", "smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    sys.stderr.write(f"\nkmgpu bench --quick ({backend}, {workload}): {seconds:.1f} s\n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "5/5" in out, out  # the progress bar over the runs reached the end
    assert "kmgpu overhead vs plain fit" in out
    results = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").exists() and (tmp_path / "smoke.png").exists()
    runs = {(r["runner"], r["devices"]): r for r in results["runs"]}
    assert set(runs) == {("plain", 1), ("kmgpu", 1), ("peer", 1), ("kmgpu", 2), ("peer", 2)}
    failed = {k: r.get("error") for k, r in runs.items() if r["status"] != "ok"}
    assert not failed, failed
    for r in runs.values():
        assert r["samples_per_s"] > 0 and r["first_epoch_s"] > 0 and r["peak_memory"] > 0
        assert len(r["epoch_seconds"]) == results["workloads"][workload]["epochs"]
    assert runs[("plain", 1)]["parity"] == 0.0
    assert runs[("kmgpu", 1)]["vs_peer"] > 0 and runs[("kmgpu", 2)]["efficiency"] > 0
    if workload != "cnn32":  # BatchNorm statistics per replica: not exact by design
        assert runs[("kmgpu", 2)]["parity"] < 1e-4, runs[("kmgpu", 2)]["parity"]
    if workload == "sine":
        assert abs(runs[("kmgpu", 2)]["rmse"] - runs[("plain", 1)]["rmse"]) < 1e-3
    assert results["backends"][backend]["status"] == "ok"


def test_missing_backends_are_skipped_with_one_line(monkeypatch, capsys):
    b = _benchmarks()
    monkeypatch.setattr(b.main, "installed", lambda name: False)
    assert b.main.main(["--quick", "--backends", "tensorflow,jax,torch"]) == 1
    lines = capsys.readouterr().out.splitlines()
    for name in ("tensorflow", "jax", "torch"):
        assert lines.count(f"kmgpu bench: skipping {name} (not installed)") == 1
    assert lines[-1] == "kmgpu bench: no backend to run."


def test_bench_arguments(capsys):
    b = _benchmarks()
    with pytest.raises(ValueError, match="unknown workload"):
        b.main.main(["--workloads", "resnet"])
    assert b.main.main(["--backends", "mxnet"]) == 2
    args = b.main.parse(["--quick", "--devices", "1,2"])
    assert args.quick and args.devices == "1,2"
    runs = b.main.plan(["jax"], ["sine"], [1, 2], replay=True)
    assert [(r["runner"], r["devices"]) for r in runs] == [
        ("plain", 1), ("kmgpu", 1), ("peer", 1), ("replay", 1), ("kmgpu", 2), ("peer", 2)]


def _synthetic():
    def run(backend, runner, n, sps, **extra):
        return {"backend": backend, "workload": "sine", "runner": runner, "devices": n,
                "status": "ok", "samples_per_s": sps, "first_epoch_s": 1.0,
                "epoch_seconds": [1.0, 0.5, 0.5], "peak_memory": 2**30, "memory_kind": "nvml",
                "loss": 0.01, "rmse": 4.86, "parity": 0.0, **extra}

    return {
        "name": "synthetic", "quick": False, "isolate": "run", "simulate": 0,
        "created": "2026-01-01T00:00:00+00:00", "command": ["kmgpu", "bench"],
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"], "cpu_count": 16, "python": "3.12"},
        "backends": {"jax": {"status": "ok", "backend_version": "0.11", "keras": "3.15.1",
                             "devices": ["gpu:0", "gpu:1"], "peer_name": "DataParallel"},
                     "tensorflow": {"status": "skipped", "reason": "not installed"}},
        "workloads": {"sine": {"description": "sine", "batch": 8, "epochs": 100}},
        "runs": [run("jax", "plain", 1, 1000.0), run("jax", "replay", 1, 990.0),
                 run("jax", "kmgpu", 1, 995.0), run("jax", "peer", 1, 1010.0),
                 run("jax", "kmgpu", 2, 1800.0, efficiency=0.9),
                 {"backend": "jax", "workload": "sine", "runner": "peer", "devices": 2,
                  "status": "error", "error": "IndivisibleError: batch 2 over 4 devices"}],
    }


def test_report_tables_and_plot(tmp_path):
    report = _benchmarks().report
    results = _synthetic()
    text = report.markdown(results)
    assert "2 x NVIDIA H200" in text and "tensorflow: skipped (not installed)" in text
    row = next(line for line in text.splitlines() if line.startswith("| sine | jax | 1 |"))
    assert "+0.5% met" in row and "+1.0%" in row and "0.985 **missed**" in row
    assert "peer failed: IndivisibleError" in text
    assert "failed: IndivisibleError" in report.runs_table(results)
    paths = report.write(results, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["synthetic.json", "synthetic.md",
                                                    "synthetic.png"]
    assert os.path.getsize(paths[-1]) > 10_000


def test_committed_results_load():
    from kmgpu import bench

    files = bench.result_files()
    assert files, "benchmarks/results holds no results"
    results = bench.load_results()
    assert results["runs"] and "kmgpu against plain fit" in bench.markdown(results)

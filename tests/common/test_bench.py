"""``kmgpu bench`` (``kmgpu/bench/``): the --quick smoke run as CI runs it, the installed
wheel, the plan and time budget, the projection's arithmetic, FLOP counts, the report.

The quick run is one command per suite: benchmarks/gpu_run.sh (the GPU command) with
--quick, the sine workload on every backend of the suite, in the one session that
scripts/test.sh names in KMGPU_BENCH_SMOKE (the others deselect it: tests/conftest.py; a
pytest run without it runs it for its own backend). The full-size workloads are built in tests/tensorflow/test_bench_workloads.py.
"""

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

from kmgpu.bench import derive, plan, projection, report, runners, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE_WORKLOADS = ("sine",)  # the cheapest; no BatchNorm: exact parity on 2 devices
NO_BATCHNORM = ("lstm", "sine")  # exact parity on 2 devices (see workloads.py)


def _backend():
    import keras

    return keras.config.backend()


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KMGPU_SIMULATE_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(extra)
    return env


def _kmgpu(args, cwd, env, timeout=300):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kmgpu"] + args, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def _smoke_backends():
    """The backends this session runs the quick bench for: KMGPU_BENCH_SMOKE (set by
    scripts/test.sh: the suite's backends in one session, empty in the others), else this
    session's own backend."""
    named = os.environ.get("KMGPU_BENCH_SMOKE")
    return [_backend()] if named is None else [b for b in named.split(",") if b]


def test_quick_bench_smoke(tmp_path):
    backends, names = _smoke_backends(), SMOKE_WORKLOADS
    # one process per backend: the units of a workload share it (a process per unit would
    # start three per backend, each importing Keras)
    # 2 epochs, the fewest a run takes (the first warms up, the second is timed): each
    # column is still filled, at 2/5 of the quick workload's epochs
    args = ["--quick", "--backends", ",".join(backends), "--workloads", ",".join(names),
            "--epochs", "2", "--isolate", "backend", "--out", str(tmp_path), "--name", "smoke"]
    # the GPU command itself, at CPU sizes (its --backends is the first; ours comes last)
    env = _clean_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    start = time.perf_counter()
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_run.sh"), backends[0]]
                          + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    seconds = time.perf_counter() - start
    sys.stderr.write(f"\nkmgpu bench --quick ({','.join(backends)}, {','.join(names)}): "
                     f"{seconds:.1f} s\n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for backend in backends:
        _check_smoke(backend, names, out, tmp_path)


def _check_smoke(backend, names, out, tmp_path):
    """One backend's part of the quick run: every run there, finished, its figures sane."""
    expected = plan.plan([backend], list(names), [1, 2], lean=True, replay=True)
    assert ".{json,md,png,log}" in out.splitlines()[0]
    assert "\x1b[" not in out and "\b" not in out  # a log: no colours, no redraws
    assert "share this machine's" in out and "not speedups" in out
    assert "budget 520 s" in out and "one process per backend" in out
    assert "kmgpu / plain fit (target >= 0.99x" in out
    assert "kmgpu / plain fit: kmgpu's samples/s over" in out
    # every ratio on one device is marked (met, missed, or not judged: noise over 5%);
    # gpu_run.sh keeps the replay (plain, kmgpu, plain): balanced
    ratios = re.findall(r"\| 1 \| global \|(?: [^|]* \|){3} ([^|]*) \|", out)
    assert ratios and all(re.fullmatch(
        r"\d+\.\d\dx (met|\*\*missed\*\*|not judged \(noise over 5%\))", r)
        for r in ratios), ratios
    assert "efficiency: speedup / N (it can exceed 1" in out and "parity: the largest" in out
    tail = out.rstrip().splitlines()
    assert any("2 simulated devices vs 1" in line for line in tail)
    # the table per model and backend comes last: a code-path check, a complete row each
    assert any(line.startswith("## kmgpu on 2 simulated devices, per model and backend: a "
                               "code-path check") for line in tail)
    assert tail[-1].startswith(f"| {names[-1]} | ")
    # a row not judged says why just above the table (its runs kept what the host did)
    noisy = re.findall(r"^\| (\w+) \| (\w+) \| [^|]* \| [^|]* \| [^|]*not judged", out, re.M)
    for workload, b in noisy:
        assert f"- {workload} on {b}, not judged: plain fit " in out, (workload, b)
    title = next(i for i, line in enumerate(tail) if line.startswith("## kmgpu on 2 sim"))
    row = next(line for line in tail[title:] if line.startswith(f"| {names[0]} | {backend} | "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert len(cells) == 12 and all(c != "-" for c in cells[2:11]), row
    results = json.loads((tmp_path / "smoke.json").read_text())
    for ext in ("md", "png", "log"):
        assert (tmp_path / f"smoke.{ext}").exists(), ext
    assert "\x1b[" not in (tmp_path / "smoke.log").read_text()
    skipped = [r for r in results["runs"] if r["status"] == "skipped"]
    # the progress bar's last count (its line may share the log with a worker's output)
    counts = re.findall(r"failed: (\d+) - skipped: (\d+)", out)
    assert counts and counts[-1] == ("0", str(len(skipped))), (
        counts, re.findall(r"\[\d+/\d+\][^\n]*", out),
        [(plan.key(r), r["status"], r.get("error") or r.get("reason"))
         for r in results["runs"] if r["status"] != "ok"])
    total = len(results["runs"])
    assert f"{total}/{total}" in out  # the progress bar reached the end
    for r in skipped:  # the reference without torchvision says how to get it
        assert "pip install torchvision" in r["reason"], r["reason"]
    runs = {plan.key(r): r for r in results["runs"] if r["backend"] == backend}
    assert set(runs) == {plan.key(r) for r in expected}
    failed = {k: r.get("error") for k, r in runs.items()
              if r["status"] == "error" or (r["status"] == "skipped"
                                            and r["runner"] != "reference")}
    assert not failed, failed
    for k, r in runs.items():
        if r["runner"] in ("allreduce", "reference") or r["status"] != "ok":
            continue
        workload = results["workloads"][r["workload"]]
        assert r["samples_per_s"] > 0 and r["first_epoch_s"] > 0 and r["peak_memory"] > 0, k
        if r["runner"] in ("plain", "kmgpu"):  # the replay is there for fit's noise
            assert r["evaluate_s"] > 0 and r["predict_s"] > 0, k
            # the same samples for every runner (per_replica: batch_size is per device)
            assert r["infer_samples"] == min(runners.INFER_BATCHES * workload["batch"],
                                           r["samples_per_epoch"]), k
        assert len(r["epoch_seconds"]) == workload["epochs"], k
        assert r["flops_per_sample"] > 0 and r["mfu"] is None, k  # no GPU peak on a CPU
        factor = 2 if r["policy"] == "per_replica" else 1
        assert r["global_batch"] == workload["batch"] * factor, k
    for name in names:
        plain = runs[(backend, name, "plain", 1, "global")]
        assert plain["parity"] == 0.0 and plain["params"] > 0
        assert plain["flops_source"]
        one = runs[(backend, name, "kmgpu", 1, "global")]
        assert one["parity"] < 1e-5
        if backend == "jax":  # kmgpu on one device runs plain fit's programs, which the
            # persistent cache holds by then: train, test and predict steps all loaded
            assert plain["cache_misses"] >= 3, plain
            assert one.get("cache_misses", 0) == 0 and one["cache_hits"] >= 3, one
        two = runs[(backend, name, "kmgpu", 2, "global")]
        assert two["vs_peer"] > 0 and two["vs_plain"] > 0
        if name in NO_BATCHNORM:
            assert two["parity"] < 1e-4, (name, two["parity"])
        if name == "sine":
            assert abs(two["rmse"] - plain["rmse"]) < 1e-3
    if backend in plan.SWEEP_BACKENDS:
        sweep = runs[(backend, "allreduce", "allreduce", 2, "global")]
        assert len(sweep["points"]) == 7 and all(t > 0 for _, t in sweep["points"])
    assert results["backends"][backend]["status"] == "ok"


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_bench_says_when_it_draws_no_plot(monkeypatch, capsys, tmp_path, terminal):
    """Without matplotlib the command announces no PNG, says why, and writes none; the
    progress line counts in integers, a log gets no terminal codes. (A budget already
    spent skips every run: nothing starts.)"""
    from kmgpu.bench import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    backend = _backend()
    assert cli.main(["--quick", "--backends", backend, "--workloads", "sine", "--budget", "1",
                     "--out", str(tmp_path), "--name", "bare"]) == 0
    out = capsys.readouterr().out
    n = len(plan.plan([backend], ["sine"], [1, 2], lean=True, replay=True))  # plain again
    lines = out.splitlines()
    assert lines[0].endswith(f"{tmp_path / 'bare'}.{{json,md,log}}"), lines[0]
    assert lines[1] == "kmgpu bench: no plot (matplotlib is not installed: pip install matplotlib)"
    assert f"{n}/{n}" in out and f"/run - failed: 0 - skipped: {n}" in out, out
    assert "e+00" not in out and "skipped: 2.0" not in out
    assert f"{n} run(s) skipped:\n  sine on {backend}: time budget spent\n" in out
    assert f"kmgpu bench: sine on {backend}: skipped, time budget spent" in out
    assert "(no plot: matplotlib is not installed: pip install matplotlib)" in out
    assert sorted(os.listdir(tmp_path)) == ["bare.json", "bare.log", "bare.md"]
    assert ("\x1b[" in out) == terminal  # a terminal gets the coloured bar


def test_the_log_keeps_no_terminal_codes(tmp_path):
    from kmgpu.bench import cli

    path = tmp_path / "x.log"
    with cli.plain_log(str(path)) as log:
        log.write("start\n\x1b[1m1/4\x1b[0m \x1b[32m━━\x1b[0m\b\b\b\r\x1b[1m4/4\x1b[0m done\n"
                  "end\n")
    assert path.read_text() == "start\n4/4 done\nend\n"
    with pytest.raises(KeyboardInterrupt), cli.plain_log(str(path)) as log:
        log.write("\x1b[31mstopped\x1b[0m\n")
        log.flush()
        raise KeyboardInterrupt  # a stopped command's log is cleaned as well
    assert path.read_text() == "stopped\n"


def test_importing_the_bench_imports_no_backend():
    code = ("import sys, kmgpu.bench, kmgpu.bench.cli, kmgpu.bench.report, kmgpu.bench.figure;"
            "print(sorted(m for m in ('keras', 'tensorflow', 'jax', 'torch') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("backend, blocked", [("torch", ["jax", "tensorflow"]),
                                              ("jax", ["tensorflow"]), ("tensorflow", [])])
def test_a_bench_process_leaves_out_the_backends_it_does_not_run(backend, blocked,
                                                                 monkeypatch):
    """Keras imports TensorFlow to seed it and JAX to patch it where they are installed:
    a bench worker of another backend takes them as not installed (None in sys.modules),
    the backends it runs untouched."""
    from kmgpu.bench import common

    modules = {k: v for k, v in sys.modules.items() if k not in ("jax", "tensorflow")}
    monkeypatch.setattr(sys, "modules", modules)  # the function's view; imports unchanged
    monkeypatch.setenv("KERAS_BACKEND", backend)
    common.without_other_backends()
    assert sorted(k for k in ("jax", "tensorflow", "torch")
                  if k in modules and modules[k] is None) == blocked


def test_no_bench_module_over_500_lines():
    for path in glob.glob(os.path.join(ROOT, "kmgpu", "bench", "*.py")):
        with open(path) as f:
            assert sum(1 for _ in f) <= 500, path


def test_missing_backends_are_skipped_with_one_line(monkeypatch, capsys):
    from kmgpu.bench import cli

    monkeypatch.setattr(cli, "installed", lambda name: False)
    assert cli.main(["--quick", "--backends", "tensorflow,jax,torch"]) == 1
    lines = capsys.readouterr().out.splitlines()
    for name in ("tensorflow", "jax", "torch"):
        assert lines.count(f"kmgpu bench: skipping {name} (not installed)") == 1
    assert lines[-1] == "kmgpu bench: no backend to run."


def test_bench_arguments(capsys):
    from kmgpu.bench import cli

    with pytest.raises(ValueError, match="unknown workload"):
        cli.main(["--workloads", "resnet"])
    assert cli.main(["--backends", "mxnet"]) == 2
    assert cli.main(["--policies", "local"]) == 2
    assert cli.main(["--runners", "horovod"]) == 2
    with pytest.raises(SystemExit):
        cli.parse(["--epochs", "1"])
    args = cli.parse(["--quick", "--devices", "1,2", "--epochs", "3", "--steps", "12",
                      "--budget", "480", "--lean"])
    assert args.quick and args.devices == "1,2" and (args.epochs, args.steps) == (3, 12)
    assert args.budget == 480 and args.lean
    w = workloads.get("resnet50", epochs=3, steps=12)
    assert (w.epochs, w.steps, w.batch, w.samples()) == (3, 12, 256, 3072)
    assert workloads.get("xception", devices=2).batch == 64  # 32 per GPU at the top count
    assert workloads.get("xception", devices=4).batch == 128
    assert workloads.get("sine", steps=5).samples() == 106  # sine: its own data


def test_plan_goes_workload_by_workload():
    """Each workload's runs on every backend before the next workload; the core unit
    (the leading table's row) first, its extras in a second pass; no peer on one device."""
    units = plan.units(["jax", "torch"], ["sine", "resnet50"], [1, 2], replay=True)
    assert [(u["workload"], u["backend"], u["core"]) for u in units] == [
        ("sine", "jax", True), ("sine", "torch", True), ("resnet50", "jax", True),
        ("resnet50", "torch", True), ("sine", "jax", False), ("sine", "torch", False),
        ("resnet50", "jax", False), ("resnet50", "torch", False),
        ("allreduce", "jax", False), ("allreduce", "torch", False)]
    # shared process: plain, kmgpu, kmgpu, plain (the replay balances the order)
    assert [(r["runner"], r["devices"], r["policy"]) for r in units[0]["runs"]] == [
        ("plain", 1, "global"), ("kmgpu", 1, "global"), ("kmgpu", 2, "global"),
        ("replay", 1, "global")]
    assert [(r["runner"], r["devices"], r["policy"]) for r in units[7]["runs"]] == [
        ("kmgpu", 2, "per_replica"), ("peer", 2, "global"), ("peer", 2, "per_replica"),
        ("reference", 1, "global")]
    one = plan.units(["tensorflow", "jax"], ["sine"], [1], replay=True, shared=False)
    assert [(u["backend"], [r["runner"] for r in u["runs"]]) for u in one] == [
        ("tensorflow", ["plain", "kmgpu"]), ("jax", ["plain", "kmgpu"]),
        ("tensorflow", ["replay"]), ("jax", ["replay"])]  # a process per run: balanced
    assert all(r["runner"] != "peer" for u in one for r in u["runs"])
    lean = plan.plan(["torch"], ["resnet50"], [1, 2], lean=True,
                     runners=("plain", "kmgpu", "peer", "reference"))
    assert [(r["runner"], r["devices"], r["policy"]) for r in lean] == [
        ("plain", 1, "global"), ("kmgpu", 1, "global"), ("kmgpu", 2, "global"),
        ("kmgpu", 2, "per_replica"), ("peer", 2, "global"), ("reference", 1, "global")]
    # a budget that covers one row, not two: the first backend's row, not neither
    now = [0.0]
    tight = plan.Budget(30, reserve=0, clock=lambda: now[0], prior={"sine": 4.0})
    two = plan.units(["jax", "torch"], ["sine"], [1, 2], replay=True, lean=True)
    assert [(u["backend"], why) for u, why in plan.Scheduler(two[:2], tight)] == [
        ("jax", None), ("torch", None)]  # nothing ran on the clock: both fit
    now[0] = 14.0  # 16 s left for two rows of 16 s
    assert [(u["backend"], why) for u, why in plan.Scheduler(two[:2], tight)] == [
        ("jax", None), ("torch", None)]


def test_plan_for_several_gpus_and_the_default_one_gpu_run():
    """--devices 1,2,4,8: the leading row first (plain, kmgpu on 1 and 8, plain again),
    then every count between, both policies, the peer, the sweep at 8. One GPU, the
    default: plain, kmgpu, plain again per workload and backend in one process, and
    torch's torchvision reference last."""
    units = plan.units(["jax", "torch"], ["xception"], [1, 2, 4, 8], replay=True)
    assert [(r["runner"], r["devices"]) for r in units[0]["runs"]] == [
        ("plain", 1), ("kmgpu", 1), ("kmgpu", 8), ("replay", 1)]
    extra = {(r["runner"], r["devices"], r["policy"]) for r in units[2]["runs"]}
    assert {(k, n, p) for k in ("kmgpu", "peer") for n in (2, 4, 8)
            for p in ("global", "per_replica")} - {("kmgpu", 8, "global")} == extra
    assert [(u["workload"], u["runs"][0]["devices"]) for u in units[-2:]] == [
        ("allreduce", 8), ("allreduce", 8)]
    assert workloads.get("xception", devices=8).batch == 256  # 32 per GPU
    one = plan.units(["jax", "torch"], list(workloads.MODELS), [1], replay=True)
    core = [u for u in one if u["core"]]
    assert [(u["workload"], u["backend"]) for u in core] == [
        (w, b) for w in workloads.MODELS for b in ("jax", "torch")]
    assert all([r["runner"] for r in u["runs"]] == ["plain", "kmgpu", "replay"] for u in core)
    assert [(u["workload"], [r["runner"] for r in u["runs"]]) for u in one if not u["core"]] \
        == [("resnet50_small", ["reference"]), ("resnet50", ["reference"])]


def test_the_default_run_shares_a_process_per_workload(capsys, tmp_path):
    from kmgpu.bench import cli

    assert cli.main(["--backends", _backend(), "--workloads", "sine", "--budget", "1",
                     "--out", str(tmp_path), "--name", "x"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "one process per workload; budget 1 s" in first, first


COSTS = {"transformer": 20.0, "cnn32": 8.0, "lstm": 5.0, "sine": 3.0}  # seconds a run


def _schedule(backends, names, seconds, shared, slow=None):
    """The planner against a fake clock: each run takes its workload's seconds (x
    ``slow[backend]``); returns every run's record and the seconds spent."""
    now, slow = [0.0], slow or {}
    budget = plan.Budget(seconds, reserve=10, clock=lambda: now[0], prior=COSTS)
    units = plan.units(backends, names, [1], replay=True, shared=shared)
    records, said = [], []
    for unit, why in plan.Scheduler(units, budget):
        if why:
            line, skipped = plan.skipped(unit, why)
            said.append(line)
            records += skipped
            continue
        for r in unit["runs"]:
            cost = COSTS[r["workload"]] * slow.get(r["backend"], 1.0)
            now[0] += cost
            budget.record(r, cost)
            records.append(dict(r, status="ok"))
    return records, now[0], said


@pytest.mark.parametrize("backends", [["jax", "torch"], ["tensorflow", "jax", "torch"]])
@pytest.mark.parametrize("shared", [True, False])
def test_planner_gives_complete_rows_at_any_budget(backends, shared):
    """Budgets from tiny to ample, workloads listed largest first: every row is complete
    or skipped whole (and said once), nothing runs past the budget, and every backend
    gets a row whenever the budget covers one each."""
    names = ["transformer", "cnn32", "lstm", "sine"]
    row_cost = COSTS["sine"] * (3 if shared else 2)  # the cheapest core unit
    for seconds in [1, 10, 15, 16, 20, 25, 30, 40, 50, 60, 80, 100, 150, 200, 300, 1000]:
        records, spent, said = _schedule(backends, names, seconds, shared)
        assert spent <= max(seconds - 10, 0), seconds
        units = {}
        for r in records:
            units.setdefault((r["workload"], r["backend"], r["runner"] == "replay"
                              and not shared), set()).add(r["status"])
        assert all(len(s) == 1 for s in units.values()), (seconds, units)  # whole or none
        assert len(said) == sum(s == {"skipped"} for s in units.values())
        complete = {b for (w, b, extra), s in units.items() if s == {"ok"} and not extra}
        if seconds - 10 >= row_cost * len(backends):
            assert complete == set(backends), (seconds, complete)
        elif seconds - 10 >= row_cost:
            assert complete, seconds
        else:
            assert not complete, seconds
        if seconds >= 1000:  # ample: every run
            assert all(r["status"] == "ok" for r in records)


def test_planner_skips_what_does_not_fit_and_says_so():
    records, _, said = _schedule(["jax", "torch"], ["sine", "transformer"], 70, shared=False)
    status = {(r["workload"], r["backend"], r["runner"]): r for r in records}
    assert status[("sine", "jax", "plain")]["status"] == "ok"
    assert status[("sine", "torch", "kmgpu")]["status"] == "ok"
    # 48 s left after sine on both (12 s): transformer on jax takes 40, then 8 are left
    assert status[("transformer", "jax", "kmgpu")]["status"] == "ok"
    assert said[0] == "transformer on torch: skipped, about 40 s needed, 8 s left"
    # torch twice as slow as guessed: after its sine runs the guess for lstm doubles (20 s
    # for two runs, not 10), so lstm on torch is skipped rather than run past the budget
    records, spent, said = _schedule(["jax", "torch"], ["sine", "lstm"], 55, shared=False,
                                     slow={"torch": 2.0})
    assert {(r["workload"], r["backend"]) for r in records if r["status"] == "ok"} == {
        ("sine", "jax"), ("sine", "torch"), ("lstm", "jax")}
    assert said[0] == "lstm on torch: skipped, about 20 s needed, 17 s left"
    assert spent == 28 + 14  # then the extras that fit: the replays


def test_time_budget():
    now = [0.0]
    budget = plan.Budget(100, reserve=10, clock=lambda: now[0])
    a = {"backend": "jax", "workload": "xception"}
    b = {"backend": "jax", "workload": "sine"}
    assert budget.refuse([a, b]) is None  # nothing known yet: try
    budget.record(a, 30.0)
    budget.record(a, 20.0)
    assert budget.estimate(a) == 30.0 and budget.estimate(b) is None
    now[0] = 55.0  # 100 - 10 - 55 = 35 s left
    assert budget.left() == 35.0
    assert budget.refuse([a]) is None
    assert budget.refuse([a, a]) == "about 60 s needed, 35 s left"
    assert budget.refuse([a], kept=10) == ("about 30 s needed, 35 s left (10 s of it kept "
                                           "for other backends' first rows)")
    now[0] = 95.0
    assert budget.refuse([b]) == "time budget spent"
    assert plan.Budget(None).refuse([a]) is None
    guess = plan.Budget(100, clock=lambda: 0.0, prior={"sine": 4.0, "xception": 40.0})
    assert guess.estimate(b) == 4.0 and guess.estimate({**a, "backend": "torch"}) == 40.0
    guess.record({"backend": "torch", "workload": "sine"}, 8.0)  # twice its guess
    assert guess.estimate({**a, "backend": "torch"}) == 80.0 and guess.estimate(a) == 40.0
    # a guess per backend; a backend it does not name gets the largest
    apart = plan.Budget(100, clock=lambda: 0.0, prior={"xception": {"jax": 34, "torch": 15}})
    assert [apart.estimate({**a, "backend": b}) for b in ("jax", "torch", "tensorflow")] \
        == [34, 15, 34]
    apart.record({"backend": "torch", "workload": "xception"}, 30.0)  # twice its guess
    assert apart.estimate({"backend": "torch", "workload": "xception"}) == 30.0


def test_projection_by_hand():
    # alpha 10 us, busbw 100 GB/s, M = 100 MB: one host
    alpha, bw, m = 10e-6, 100e9, 100e6
    assert projection.ring_time(1, m, alpha, bw) == 0.0
    assert projection.ring_time(2, m, alpha, bw) == pytest.approx(20e-6 + 1e-3)
    assert projection.ring_time(4, m, alpha, bw) == pytest.approx(60e-6 + 1.5e-3)
    assert projection.ring_time(8, m, alpha, bw) == pytest.approx(140e-6 + 1.75e-3)
    # 2 hosts of 8: inside 1.89 ms, between 2 x 10 us + 1 x 100 MB / 50 GB/s = 2.02 ms
    assert projection.allreduce_time(16, m, alpha, bw) == pytest.approx(1.89e-3 + 2.02e-3)
    # 8 hosts: 7/4 x 2 ms + 14 x 10 us
    assert projection.allreduce_time(64, m, alpha, bw) == pytest.approx(
        1.89e-3 + 140e-6 + 3.5e-3)
    assert projection.allreduce_time(16, m, alpha, bw, net_gbps=800, net_latency_us=0) == \
        pytest.approx(1.89e-3 + 1e-3)
    # steps: 9 ms of compute, 3 ms all-reduce: 12 ms, or hidden under the 6 ms backward
    assert projection.step_time(9e-3, 3e-3, False) == pytest.approx(12e-3)
    assert projection.step_time(9e-3, 3e-3, True) == pytest.approx(9e-3)
    assert projection.step_time(3e-3, 3e-3, True) == pytest.approx(4e-3)
    # global batch, 2 GPUs, 20 ms of compute on one: 10 / (10 + 1.02) and 10 / 10
    eff = projection.project(20e-3, m, alpha, bw, "global", counts=(2, 4))
    assert eff[2] == pytest.approx((10 / 11.02, 1.0))
    # 4 GPUs: 5 ms compute, 1.56 ms all-reduce; overlapped: 1.56 - 3.33 < 0
    assert eff[4] == pytest.approx((5 / 6.56, 1.0))
    weak = projection.project(20e-3, m, alpha, bw, "per_replica", counts=(8,))
    assert weak[8] == pytest.approx((20 / 21.89, 1.0))
    tight = projection.efficiency(8, "global", 6e-3, m, alpha, bw, True)
    assert tight == pytest.approx(0.75e-3 / (0.75e-3 + 1.89e-3 - 0.5e-3))
    assert projection.bus_bandwidth(100e6, 1e-3, 2) == pytest.approx(100e9)
    assert projection.bus_bandwidth(100e6, 1e-3, 4) == pytest.approx(150e9)


def test_alpha_beta_fit_recovers_the_model():
    for p in (2, 4):
        points = [(m, projection.ring_time(p, m, 8e-6, 200e9)) for m in (4096, 2**20, 2**26)]
        alpha, busbw = projection.fit_alpha_beta(points, p)
        assert alpha == pytest.approx(8e-6) and busbw == pytest.approx(200e9)
    with pytest.raises(ValueError, match="does not grow"):
        projection.fit_alpha_beta([(1024, 2e-3), (2**20, 1e-3)], 2)
    with pytest.raises(ValueError):
        projection.fit_alpha_beta([(1024, 2e-3)], 2)


def test_flops_by_hand():
    import keras

    from kmgpu.bench import flops

    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(20),
                              keras.layers.Dense(1)])
    assert flops.analytic(model) == 3 * 2 * (10 * 20 + 20 * 1)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)  # 2 x 27 x 4 x 64 positions
    h = keras.layers.DepthwiseConv2D(3, strides=2, padding="same")(h)  # 2 x 36 x 16
    h = keras.layers.SeparableConv2D(6, 3, padding="same")(h)  # 2 x (36 + 24) x 16
    conv = keras.Model(inputs, h)
    assert flops.analytic(conv) == 3 * (2 * 108 * 64 + 2 * 36 * 16 + 2 * 60 * 16)
    rnn = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4)])
    assert flops.analytic(rnn) == 3 * 5 * 2 * (3 * 16 + 4 * 16)
    counted, source = flops.per_sample(model, _DenseWorkload(), keras.config.backend())
    assert 0.5 < counted / flops.analytic(model) < 2.0, (counted, source)
    assert flops.peak_flops("NVIDIA H200", "tf32") == 495e12
    assert flops.peak_flops("NVIDIA H200", "bf16") == 989e12
    assert flops.peak_flops("NVIDIA H200", "fp32") == 67e12
    assert flops.peak_flops("cpu", "fp32") is None
    assert flops.mfu(1e9, 1000, 2, 1e12) == pytest.approx(0.5)
    assert flops.mfu(1e9, 1000, 2, None) is None
    # torch: kmgpu's steps set TF32 themselves, whatever torch's global flags say after them
    if keras.config.backend() == "torch":
        assert flops.precision("torch", "matmul", torch_tf32=True) == "tf32"
        assert flops.precision("torch", "conv", torch_tf32=False) == "fp32"


class _DenseWorkload:
    loss = "mse"

    def data(self):
        import numpy as np

        return np.ones((4, 10), "float32"), np.ones((4, 1), "float32")


def _synthetic():
    def run(backend, runner, n, sps, policy="global", **extra):
        return {"backend": backend, "workload": "resnet50", "runner": runner, "devices": n,
                "policy": policy, "status": "ok", "samples_per_s": sps, "first_epoch_s": 40.0,
                "epoch_seconds": [40.0, 0.5, 0.5], "peak_memory": 2**34,
                "memory_kind": "nvml", "loss": 6.9, "global_batch": 256 * (
                    2 if policy == "per_replica" else 1), "precision": "tf32",
                "peak_flops": 495e12, **extra}

    sweep = [(m, projection.ring_time(2, m, 10e-6, 100e9)) for m in (4096, 2**20, 2**26)]
    return {
        "name": "synthetic", "quick": False, "isolate": "run", "simulate": 0,
        "created": "2026-12-01T00:00:00+00:00", "command": ["kmgpu", "bench"],
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"], "cpu_count": 16, "python": "3.12"},
        "backends": {"jax": {"status": "ok", "backend_version": "0.11", "keras": "3.15.1",
                             "devices": ["gpu:0", "gpu:1"], "peer_name": "DataParallel"},
                     "tensorflow": {"status": "skipped", "reason": "not installed"}},
        "workloads": {"resnet50": {"description": "ResNet50", "batch": 256, "epochs": 3,
                                   "steps": 10}},
        "runs": [run("jax", "plain", 1, 3600.0, flops_per_sample=24e9, params=25_000_000,
                     grad_bytes=100_000_000, flops_source="XLA cost analysis"),
                 run("jax", "kmgpu", 1, 3564.0),
                 run("jax", "kmgpu", 2, 6480.0, runs_before=1),
                 run("jax", "kmgpu", 2, 7020.0, "per_replica"),
                 run("jax", "peer", 2, 6000.0),
                 {"backend": "jax", "workload": "resnet50", "runner": "peer", "devices": 1,
                  "policy": "global", "status": "error",
                  "error": "IndivisibleError: batch 2 over 4 devices"},
                 {"backend": "jax", "workload": "resnet50", "runner": "peer", "devices": 2,
                  "policy": "per_replica", "status": "skipped",
                  "reason": "time budget spent"},
                 {"backend": "jax", "workload": "allreduce", "runner": "allreduce",
                  "devices": 2, "policy": "global", "status": "ok", "method": "psum",
                  "points": sweep, "alpha_s": 10e-6, "busbw": 100e9,
                  "busbw_points": [projection.bus_bandwidth(m, t, 2) for m, t in sweep]}],
    }


def test_report_leads_with_the_table_per_model(tmp_path):
    results = _synthetic()
    derive.derive(results)
    runs = derive.index(results)
    two = runs[("jax", "resnet50", "kmgpu", 2, "global")]
    assert two["vs_plain"] == pytest.approx(1.8) and two["vs_peer"] == pytest.approx(1.08)
    assert two["mfu"] == pytest.approx(24e9 * 6480 / (2 * 495e12))
    assert runs[("jax", "resnet50", "kmgpu", 2, "per_replica")]["efficiency"] == \
        pytest.approx(7020 / (2 * 3564))
    text = report.markdown(results)
    lines = text.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert lines[first_table] == "## kmgpu on 2 H200s, per model and backend"
    row = next(line for line in lines if line.startswith("| resnet50 | jax | 6,480 |"))
    assert [c.strip() for c in row.split("|")[1:-1]] == [
        "resnet50", "jax", "6,480", "3,600", "0.99x", "-", "1.80x", "0.90", "40.0*", "-", "-",
        "-"]
    assert "![samples/s per model and backend](synthetic.png)" in lines
    second = next(i for i, line in enumerate(lines) if i > first_table and line.startswith("## "))
    assert lines[second] == "## 2 H200s vs 1: speedup per workload, backend and batch policy"
    row = next(line for line in lines if line.startswith("| resnet50 | jax | global |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3:9] == ["256 -> 256", "3,600", "6,480", "1.80x", "0.90", "1.08"]
    assert cells[9] == f"{24e9 * 3600 / 495e12 * 100:.1f}% -> {24e9 * 6480 / 990e12 * 100:.1f}%"
    assert cells[10] == "40.0 -> 40.0*" and cells[11] == "16.00 GiB"
    row = next(line for line in lines if line.startswith("| resnet50 | jax | per_replica |"))
    assert "256 -> 512" in row and "1.95x" in row
    assert "tensorflow: skipped (not installed)" in text
    assert "| 0.99x met | - | peer failed: " in text  # 3564 / 3600; no replay: no noise
    assert "| 1.80x | - | 1.08x met |" in text  # at N = 2 the speed-up (no target), the peer
    assert "peer failed: IndivisibleError" in text and "time budget spent" in text
    assert "TF32 (495 TFLOP/s)" in text and "XLA cost analysis" in text
    # projection: t_c = 256 / 3600 s; M = 100 MB; 2 GPUs: 35.6 ms / (35.6 + 1.02) ms
    proj = next(line for line in lines if line.startswith("| resnet50 | jax | global | 71.11"))
    t_c = 256 / 3600 / 2
    assert f"{t_c / (t_c + 1.02e-3):.2f} / 1.00" in proj and "| 0.90 |" in proj
    assert "alpha-beta" in text and "busbw 100.0 GB/s" in text
    assert "## Modelled, not measured: projected scaling efficiency" in text
    paths = report.write(results, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["synthetic.json", "synthetic.md",
                                                    "synthetic.png"]
    assert os.path.getsize(paths[-1]) > 10_000


def test_the_report_names_no_machine_path():
    results = _synthetic()
    results["command"] = ["kmgpu", "bench", "--out", "/root/out", "--report", "/tmp/x/a.json"]
    text = report.markdown(results)
    assert "`kmgpu bench --out .../out --report .../a.json`" in text
    assert "/root" not in text and "/tmp" not in text


def test_merge_one_file_per_backend():
    a, b = _synthetic(), _synthetic()
    for r in b["runs"]:
        r["backend"] = "torch"
    b["backends"] = {"torch": dict(a["backends"]["jax"], peer_name="DDP loop")}
    b["name"] = "torch-run"
    merged = report.merge([a, b])
    derive.derive(merged)
    assert merged["name"] == "synthetic+torch-run" and len(merged["runs"]) == 16
    assert set(merged["backends"]) == {"jax", "tensorflow", "torch"}
    assert "| workload | Keras/jax | Keras/torch |" in report.markdown(merged)


def test_committed_results_load():
    from kmgpu import bench

    files = bench.result_files()
    assert files, "benchmarks/results holds no results"
    results = bench.load_results()
    assert results["runs"] and "kmgpu against plain fit" in bench.markdown(results)
    for path in files:  # every committed file, old format included, still renders
        assert "## Every run" in bench.markdown(bench.load_results(path))

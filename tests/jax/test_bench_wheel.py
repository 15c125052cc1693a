"""``kmgpu bench`` from a wheel installed outside the checkout. Backend-neutral:
it runs once, in the JAX session (the installed copy runs its --quick on JAX).
"""

import glob
import json
import os
import subprocess
import sys

from tests.common.test_bench import ROOT, _clean_env, _kmgpu


def test_installed_wheel_runs_outside_the_checkout(tmp_path):
    """pip wheel + pip install --target outside the checkout: kmgpu bench --help and a
    tiny --quick run work from the installed copy, results in ./kmgpu-bench."""
    import shutil

    src = tmp_path / "src"  # a copy: the build writes nothing into the checkout
    shutil.copytree(os.path.join(ROOT, "kmgpu"), src / "kmgpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    wheels, site, cwd = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    cwd.mkdir()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                          str(src)], check=True, capture_output=True, timeout=300)
    wheel = glob.glob(str(wheels / "kmgpu-*.whl"))
    assert len(wheel) == 1, wheel
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), wheel[0]], check=True,
                   capture_output=True, timeout=300)
    env = _clean_env(PYTHONPATH=str(site), KERAS_BACKEND="jax")
    where = subprocess.run(
        [sys.executable, "-c", "import kmgpu.bench.paths as p; print(p.__file__); "
         "print(p.default_out()); print(p.results_folder())"],
        cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(site)), where  # the installed copy, not the checkout
    assert where[1:] == [str(cwd / "kmgpu-bench"), "None"]

    proc, _ = _kmgpu(["bench", "--help"], cwd, env, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--budget" in proc.stdout

    # one run (kmgpu on 2 devices): the whole of a run's code path, from the installed
    # copy; the quick bench's every run is tests/common/test_bench.py's smoke test
    proc, seconds = _kmgpu(["bench", "--quick", "--backends", "jax", "--workloads", "sine",
                            "--runners", "kmgpu", "--devices", "2", "--policies", "global",
                            "--no-replay", "--name", "wheel"], cwd, env)
    sys.stderr.write(f"\nkmgpu bench --quick from the wheel: {seconds:.1f} s\n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((cwd / "kmgpu-bench" / "wheel.json").read_text())
    assert [(r["runner"], r["devices"], r["status"]) for r in results["runs"]] == [
        ("kmgpu", 2, "ok")], results["runs"]
    assert results["runs"][0]["samples_per_s"] > 0
    for ext in ("md", "png", "log"):
        assert (cwd / "kmgpu-bench" / f"wheel.{ext}").exists(), ext
    assert not os.path.exists(os.path.join(str(site), "benchmarks"))

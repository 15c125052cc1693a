"""``kmgpu bench``: plan the runs, start one process per backend (or per run), show a
progress bar over the runs, then work out parity and ratios and write the report.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile

from benchmarks import report, workloads

BACKENDS = ("tensorflow", "jax", "torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results")


def parse(argv):
    p = argparse.ArgumentParser(
        prog="kmgpu bench",
        description="Throughput, first-epoch (compile) time, scaling efficiency, parity and "
                    "peak memory of kmgpu against plain model.fit and each framework's own "
                    "data-parallel way, per backend, for 1..all devices.")
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized workloads (CI smoke test); simulates 2 devices when there "
                        "is no GPU and runs each backend in one process")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated (default: %(default)s; missing ones are skipped)")
    p.add_argument("--workloads", default=",".join(workloads.NAMES),
                   help="comma-separated from %(default)s")
    p.add_argument("--devices", default=None,
                   help="device counts, e.g. 1,2,4 (default: 1 to all)")
    p.add_argument("--simulate", type=int, default=None,
                   help="simulated devices on a CPU-only machine (default: 2 with --quick "
                        "and no GPU, else none)")
    p.add_argument("--isolate", choices=("run", "workload", "backend"), default=None,
                   help="a fresh process for every run (default without --quick: fair "
                        "first-epoch times, exact peak memory), one per backend and workload "
                        "(later runs find warm caches and memory already held), or one per "
                        "backend (default with --quick)")
    p.add_argument("--replay", dest="replay", action="store_true", default=None,
                   help="run plain fit twice: the second run gives the run-to-run noise of "
                        "the timings and of parity (default: on, off with --quick)")
    p.add_argument("--no-replay", dest="replay", action="store_false")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the results (%(default)s)")
    p.add_argument("--name", default=None,
                   help="file name stem for <name>.json/.md/.png (default: from the machine)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a worker process is stopped (default: none)")
    return p.parse_args(argv)


def installed(backend):
    return importlib.util.find_spec(backend) is not None


def slug(text):
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def plan(backends, names, counts, replay=False):
    """The runs, in order: per backend and workload, plain fit first (the reference for
    parity), then kmgpu and the peer at each device count; the replay of plain fit
    comes after the one-device runs."""
    runs = []
    for backend in backends:
        for name in names:
            runs.append({"backend": backend, "workload": name, "runner": "plain", "devices": 1})
            for n in counts:
                runs.append({"backend": backend, "workload": name, "runner": "kmgpu",
                             "devices": n})
                runs.append({"backend": backend, "workload": name, "runner": "peer",
                             "devices": n})
                if n == 1 and replay:
                    runs.append({"backend": backend, "workload": name, "runner": "replay",
                                 "devices": 1})
    return runs


def main(argv=None):
    saved = dict(os.environ)
    try:
        return _main(argv, saved)
    finally:  # this process's environment as it was (a notebook kernel runs on)
        os.environ.clear()
        os.environ.update(saved)


def _main(argv, child_env):
    args = parse(sys.argv[1:] if argv is None else argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name in names:
        workloads.get(name)  # ValueError for an unknown one
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends_info, backends = {}, []
    for b in wanted:
        if b not in BACKENDS:
            print(f"kmgpu bench: unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
            return 2
        if installed(b):
            backends.append(b)
        else:
            print(f"kmgpu bench: skipping {b} (not installed)")
            backends_info[b] = {"status": "skipped", "reason": "not installed"}
    if not backends:
        print("kmgpu bench: no backend to run.")
        return 1

    # This process only draws the progress bar with Keras: keep it off the GPUs.
    os.environ.setdefault("KERAS_BACKEND", next(b for b in ("jax", "torch", "tensorflow")
                                                if installed(b)))
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from kmgpu.callbacks import nvidia_gpus, visible_gpu_indices

    gpus = nvidia_gpus()
    gpus = [gpus[i] for i in _visible(child_env, len(gpus), visible_gpu_indices)]
    simulate = args.simulate
    if simulate is None:
        simulate = 2 if (args.quick and not gpus) else 0
    total = simulate or len(gpus) or 1
    counts = (sorted({int(c) for c in args.devices.split(",")}) if args.devices
              else list(range(1, total + 1)))
    if counts and counts[-1] > total:
        print(f"kmgpu bench: --devices {args.devices} asks for more than the {total} "
              "device(s) here" + ("" if gpus else "; pass --simulate N on a CPU-only machine"))
        return 2
    isolate = args.isolate or ("backend" if args.quick else "run")
    name = args.name or ((slug(gpus[0]) + f"-x{len(gpus)}") if gpus else
                         f"cpu-sim{simulate}" if simulate else "cpu") + \
        ("-quick" if args.quick else "")
    replay = (not args.quick) if args.replay is None else args.replay
    runs = plan(backends, names, counts, replay)

    import keras

    print(f"kmgpu bench: {len(runs)} runs ({', '.join(backends)}; {', '.join(names)}; "
          f"devices {counts}{'; simulated' if simulate else ''}; one process per {isolate})"
          f" -> {os.path.join(args.out, name)}.{{json,md,png}}", flush=True)
    bar = keras.utils.Progbar(len(runs), unit_name="run", stateful_metrics=["failed"])
    done, failures = [0], [0]
    results = {
        "name": name, "quick": args.quick, "isolate": isolate, "simulate": simulate,
        "replay": replay,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["kmgpu", "bench"] + list(sys.argv[1:] if argv is None else argv),
        "machine": {"gpus": gpus, "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "backends": backends_info,
        "workloads": {n: workloads.get(n, args.quick).to_dict() for n in names},
        "runs": [],
    }
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, name + ".log")
    with tempfile.TemporaryDirectory(prefix="kmgpu-bench-") as tmp, open(log_path, "w") as log:
        for backend in backends:
            mine = [r for r in runs if r["backend"] == backend]
            if isolate == "backend":
                batches = [mine]
            elif isolate == "workload":
                batches = [[r for r in mine if r["workload"] == w] for w in names]
            else:
                batches = [[r] for r in mine]
            env = dict(child_env, KERAS_BACKEND=backend)
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            # JAX takes 75% of each GPU up front unless told not to; without that the
            # memory figures (nvidia-smi's) would say nothing. The same for every JAX run.
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            wdir = os.path.join(tmp, backend)
            os.makedirs(wdir, exist_ok=True)
            for batch in batches:
                records = _run_worker(backend, batch, args, simulate, wdir, env, log, tmp)
                for rec in records:
                    if rec.get("kind") == "env":
                        info = backends_info.setdefault(backend, {"status": "ok"})
                        info.update({k: v for k, v in rec.items() if k != "kind"})
                        info["peer_name"] = _peer_name(backend)
                        continue
                    rec["peer_name"] = _peer_name(backend) if rec["runner"] == "peer" else None
                    results["runs"].append(rec)
                    done[0] += 1
                    failures[0] += rec["status"] != "ok"
                    bar.update(done[0], values=[("failed", failures[0])])
                    _save_partial(results, args.out)
        for b in backends:
            backends_info.setdefault(b, {"status": "failed", "reason": "no worker started"})
        _derive(results)
        for r in results["runs"]:
            r.pop("weights_file", None)
    paths = report.write(results, args.out)
    partial = os.path.join(args.out, results["name"] + ".partial.json")
    if os.path.exists(partial):
        os.remove(partial)
    print()
    print(report.comparison_table(results))
    failed = [r for r in results["runs"] if r["status"] != "ok"]
    if failed:
        print(f"\n{len(failed)} run(s) failed (details in {log_path}):")
        for r in failed:
            print(f"  {r['backend']} {r['workload']} {r['runner']} N={r['devices']}: "
                  f"{r.get('error')}")
    print("\nwrote " + ", ".join(paths + [log_path]))
    return 0


def _save_partial(results, folder):
    """The JSON so far (without derived figures), in case the whole command is stopped."""
    path = os.path.join(folder, results["name"] + ".partial.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def _visible(env, count, visible_gpu_indices):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if "CUDA_VISIBLE_DEVICES" in env:
            os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        return visible_gpu_indices(count)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _peer_name(backend):
    from benchmarks.runners import PEER_NAMES

    return PEER_NAMES[backend]


def _run_worker(backend, batch, args, simulate, wdir, env, log, tmp):
    """Start one worker for ``batch`` (runs of one backend); yield its records."""
    spec = {"runs": [{k: r[k] for k in ("workload", "runner", "devices")} for r in batch],
            "quick": args.quick, "simulate": simulate, "weights_dir": wdir}
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    log.write(f"=== {backend}: {json.dumps(spec['runs'])}\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", spec_path],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    seen = set()
    timer = None
    if args.timeout:
        import threading

        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
    try:
        for line in proc.stdout:
            if line.startswith("KMGPU-BENCH "):
                rec = json.loads(line[len("KMGPU-BENCH "):])
                if rec.get("kind") == "run":
                    rec["backend"] = backend
                    seen.add((rec["workload"], rec["runner"], rec["devices"]))
                yield rec
            else:
                log.write(line)
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
    log.flush()
    for r in batch:
        if (r["workload"], r["runner"], r["devices"]) not in seen:
            yield {"kind": "run", **r, "status": "error",
                   "error": f"worker process ended (exit status {rc}) before this run finished"}


def _derive(results):
    """Parity against plain fit, efficiency against the same runner's N=1, ratios."""
    import numpy as np

    runs = {(r["backend"], r["workload"], r["runner"], r["devices"]): r
            for r in results["runs"] if r["status"] == "ok"}
    for (backend, workload, runner, n), r in runs.items():
        plain = runs.get((backend, workload, "plain", 1))
        if plain and r.get("weights_file") and plain.get("weights_file"):
            a, b = np.load(plain["weights_file"]), np.load(r["weights_file"])
            r["parity"] = rel_diff([a[k] for k in sorted(a.files, key=_arr_index)],
                                   [b[k] for k in sorted(b.files, key=_arr_index)])
        one = runs.get((backend, workload, runner, 1))
        if one:
            r["efficiency"] = r["samples_per_s"] / (n * one["samples_per_s"])
        if plain:
            r["vs_plain"] = r["samples_per_s"] / plain["samples_per_s"]
        if runner == "kmgpu":
            peer = runs.get((backend, workload, "peer", n))
            if peer:
                r["vs_peer"] = r["samples_per_s"] / peer["samples_per_s"]


def _arr_index(key):
    return int(key.split("_")[-1])


def rel_diff(a_weights, b_weights):
    """Largest relative difference between two weight lists (max |a-b| / max |a|, per
    tensor), as tests/helpers.rel_diff."""
    import numpy as np

    if len(a_weights) != len(b_weights):
        return float("nan")
    worst = 0.0
    for a, b in zip(a_weights, b_weights):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return float("nan")
        worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)))
    return worst

"""``kmgpu bench``: parse the options, plan the runs, start one worker process per run (or
per workload, or per backend), show a progress bar over the runs, keep to the time budget,
then work out the derived figures and write the report.
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
import time

from kmgpu.bench import derive, paths, plan, report, workloads

BACKENDS = ("tensorflow", "jax", "torch")


def parse(argv):
    p = argparse.ArgumentParser(
        prog="kmgpu bench",
        description="Throughput, speedup over plain fit on one device, scaling efficiency, "
                    "MFU, first-epoch (compile) time, parity and peak memory of kmgpu against "
                    "plain model.fit and each framework's own data-parallel way, per backend, "
                    "workload and batch policy; plus an all-reduce sweep and a projection to "
                    "more GPUs.")
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized workloads (CI smoke test); simulates 2 devices when there "
                        "is no GPU and runs each backend in one process")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated (default: %(default)s; missing ones are skipped)")
    p.add_argument("--workloads", default=",".join(workloads.NAMES),
                   help="comma-separated from %(default)s")
    p.add_argument("--devices", default=None,
                   help="device counts, e.g. 1,2,4 (default: 1 to all)")
    p.add_argument("--policies", default=",".join(plan.POLICIES),
                   help="batch policies for N > 1 devices (default: %(default)s)")
    p.add_argument("--runners", default=",".join(plan.RUNNERS),
                   help="which runs, from %(default)s (plain fit is the reference of every "
                        "ratio)")
    p.add_argument("--lean", action="store_true",
                   help="leave out the peer's per_replica and one-device runs (as --quick "
                        "does): the peer then runs at the top device count, global batch")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs per run (default: the workload's; at least 2: the first "
                        "includes compilation and is not in samples/s)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per epoch at the run's global batch (default: the workload's)")
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
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole command: runs that would not fit are skipped "
                        "(marked in the report), most useful first (default: no limit)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a worker process is stopped (default: none)")
    p.add_argument("--out", default=None,
                   help=f"folder for the results (default: {paths.default_out()})")
    p.add_argument("--name", default=None,
                   help="file name stem for <name>.json/.md/.png (default: from the machine)")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="run nothing: merge these results files (e.g. one per backend) into "
                        "one report <name>.json/.md/.png in --out")
    p.add_argument("--gpus-per-host", type=int, default=None, help="projection: GPUs per "
                   "host (default 8)")
    p.add_argument("--net-gbps", type=float, default=None,
                   help="projection: network bandwidth per host in Gb/s (default 400)")
    p.add_argument("--net-latency-us", type=float, default=None,
                   help="projection: latency per inter-host ring step in us (default 10)")
    args = p.parse_args(argv)
    if args.epochs is not None and args.epochs < 2:
        p.error("--epochs must be 2 or more (samples/s leaves out the first epoch)")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be 1 or more")
    return args


def installed(backend):
    return importlib.util.find_spec(backend) is not None


def slug(text):
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def _split(text):
    return [w.strip() for w in text.split(",") if w.strip()]


def projection_params(args):
    return {k: v for k, v in (("gpus_per_host", args.gpus_per_host),
                              ("net_gbps", args.net_gbps),
                              ("net_latency_us", args.net_latency_us)) if v is not None}


def main(argv=None):
    saved = dict(os.environ)
    try:
        return _main(list(sys.argv[1:] if argv is None else argv), saved)
    finally:  # this process's environment as it was (a notebook kernel runs on)
        os.environ.clear()
        os.environ.update(saved)


def _main(argv, child_env):
    args = parse(argv)
    out = args.out or paths.default_out()
    if args.report:
        return _merge_only(args, out, argv)
    names = _split(args.workloads)
    for name in names:
        workloads.get(name)  # ValueError for an unknown one
    for policy in _split(args.policies):
        if policy not in plan.POLICIES:
            print(f"kmgpu bench: unknown policy {policy!r}; choose from "
                  f"{', '.join(plan.POLICIES)}")
            return 2
    for runner in _split(args.runners):
        if runner not in plan.RUNNERS:
            print(f"kmgpu bench: unknown runner {runner!r}; choose from "
                  f"{', '.join(plan.RUNNERS)}")
            return 2
    backends_info, backends = {}, []
    for b in _split(args.backends):
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

    gpus = nvidia_gpus() or _nvidia_smi_gpus()
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
    runs = plan.plan(backends, names, counts, replay, _split(args.policies),
                     _split(args.runners), lean=args.quick or args.lean)
    top = max(counts)

    import keras

    print(f"kmgpu bench: {len(runs)} runs ({', '.join(backends)}; {', '.join(names)}; "
          f"devices {counts}{'; simulated' if simulate else ''}; one process per {isolate}"
          + (f"; budget {args.budget:.0f} s" if args.budget else "")
          + f") -> {os.path.join(out, name)}.{{json,md,png}}", flush=True)
    if simulate:
        print(f"kmgpu bench: the {simulate} simulated devices share this machine's "
              f"{os.cpu_count()} CPU core(s): the figures test the code, they are not "
              "speedups.", flush=True)
    bar = keras.utils.Progbar(len(runs), unit_name="run",
                              stateful_metrics=["failed", "skipped"])
    counter = {"done": 0, "failed": 0, "skipped": 0}
    results = {
        "name": name, "quick": args.quick, "isolate": isolate, "simulate": simulate,
        "replay": replay, "devices": counts, "lean": args.quick or args.lean,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["kmgpu", "bench"] + argv,
        "machine": {"gpus": gpus, "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "backends": backends_info,
        "workloads": {n: workloads.get(n, args.quick, top, args.epochs, args.steps).to_dict()
                      for n in names},
        "projection": projection_params(args),
        "runs": [],
    }
    budget = plan.Budget(args.budget)
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, name + ".log")

    def finished(rec):
        results["runs"].append(rec)
        counter["done"] += 1
        counter["failed"] += rec["status"] == "error"
        counter["skipped"] += rec["status"] == "skipped"
        bar.update(counter["done"], values=[("failed", counter["failed"]),
                                            ("skipped", counter["skipped"])])
        _save_partial(results, out)

    spec = {"quick": args.quick, "simulate": simulate, "max_devices": top,
            "epochs": args.epochs, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="kmgpu-bench-") as tmp, open(log_path, "w") as log:
        for backend in backends:
            env = _worker_env(child_env, backend, quick_cpu=args.quick and not gpus)
            wdir = os.path.join(tmp, backend)
            os.makedirs(wdir, exist_ok=True)
            if args.quick:  # JAX: runs of the same program share the compiled code
                spec["jax_cache"] = os.path.join(tmp, "jax-cache")
            for batch in _batches([r for r in runs if r["backend"] == backend], isolate,
                                  names):
                why = budget.refuse(batch)
                if why:
                    for r in batch:
                        finished({**r, "status": "skipped", "reason": why})
                    continue
                left = budget.left()
                by_budget = left is not None and (args.timeout is None or left < args.timeout)
                timeout = left if by_budget else (args.timeout or float("inf"))
                for rec in _run_worker(batch, dict(spec, weights_dir=wdir), env, log, tmp,
                                       timeout, budget, by_budget):
                    if rec.get("kind") == "env":
                        info = backends_info.setdefault(backend, {"status": "ok"})
                        info.update({k: v for k, v in rec.items() if k != "kind"})
                        info["peer_name"] = derive.peer_name(backend)
                        continue
                    rec.pop("kind", None)
                    rec["backend"] = backend
                    finished(rec)
        for b in backends:
            backends_info.setdefault(b, {"status": "failed", "reason": "no worker started"})
        derive.derive(results)
        for r in results["runs"]:
            r.pop("weights_file", None)
    paths_written = report.write(results, out)
    partial = os.path.join(out, results["name"] + ".partial.json")
    if os.path.exists(partial):
        os.remove(partial)
    print()
    _finish(results, paths_written + [log_path], log_path)
    return 0


def _finish(results, written, log_path=None):
    failed = [r for r in results["runs"] if r["status"] == "error"]
    if failed:
        print(f"{len(failed)} run(s) failed" + (f" (details in {log_path})" if log_path else "")
              + ":")
        for r in failed:
            print(f"  {r['backend']} {r['workload']} {r['runner']} N={r['devices']} "
                  f"{r.get('policy', 'global')}: {r.get('error')}")
    skipped = [r for r in results["runs"] if r["status"] == "skipped"]
    if skipped:
        print(f"{len(skipped)} run(s) skipped: " + "; ".join(sorted(
            {r.get("reason", "?") for r in skipped})))
    print("\nwrote " + ", ".join(written) + "\n")
    print(report.comparison_table(results))
    print()
    print(report.headline(results))


def _merge_only(args, out, argv):
    merged = report.merge([report.load(p) for p in args.report])
    merged["name"] = args.name or merged["name"]
    merged["projection"].update(projection_params(args))
    merged["command"] = ["kmgpu", "bench"] + argv
    derive.derive(merged)
    _finish(merged, report.write(merged, out))
    return 0


def _batches(mine, isolate, names):
    if isolate == "backend":
        return [mine] if mine else []
    if isolate == "workload":
        groups = [[r for r in mine if r["workload"] == w] for w in names + ["allreduce"]]
        return [g for g in groups if g]
    return [[r] for r in mine]


def _worker_env(child_env, backend, quick_cpu=False):
    env = dict(child_env, KERAS_BACKEND=backend)
    if quick_cpu:  # XLA on a CPU: compile fast rather than well (a smoke test's programs)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                            " --xla_llvm_disable_expensive_passes=true").strip()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # JAX takes 75% of each GPU up front unless told not to; without that the memory
    # figures (nvidia-smi's) would say nothing. The same for every JAX run.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # The worker imports this very kmgpu, wherever it is installed.
    env["PYTHONPATH"] = paths.PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _nvidia_smi_gpus():
    """GPU names from ``nvidia-smi -L`` where NVML's Python binding is not installed."""
    try:
        text = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(UUID")[0].strip() for line in text.splitlines()
            if line.startswith("GPU ") and ":" in line]


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


def _run_worker(batch, spec, env, log, tmp, timeout, budget, by_budget=False):
    """Start one worker for ``batch`` (runs of one backend); yield its records."""
    spec = dict(spec, runs=[{k: r[k] for k in ("workload", "runner", "devices", "policy")}
                            for r in batch])
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    log.write(f"=== {batch[0]['backend']}: {json.dumps(spec['runs'])}\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "kmgpu.bench.worker", spec_path],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    seen, stopped = set(), []
    timer = None
    if timeout != float("inf"):
        import threading

        def stop():
            stopped.append(True)
            proc.kill()

        timer = threading.Timer(max(timeout, 1.0), stop)
        timer.start()
    since = time.monotonic()
    try:
        for line in proc.stdout:
            if line.startswith("KMGPU-BENCH "):
                rec = json.loads(line[len("KMGPU-BENCH "):])
                if rec.get("kind") == "run":
                    rec["policy"] = rec.get("policy", "global")
                    seen.add(plan.key({**rec, "backend": batch[0]["backend"]}))
                    now = time.monotonic()
                    budget.record({**rec, "backend": batch[0]["backend"]}, now - since)
                    since = now
                yield rec
            else:
                log.write(line)
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
    log.flush()
    for r in batch:
        if plan.key(r) not in seen:
            if stopped and by_budget:
                yield {"kind": "run", **r, "status": "skipped",
                       "reason": "stopped at the time budget (--budget)"}
                continue
            why = ("stopped after --timeout seconds" if stopped else
                   f"worker process ended (exit status {rc}) before this run finished")
            yield {"kind": "run", **r, "status": "error", "error": why}

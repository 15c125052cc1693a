"""``kmgpu bench``: parse the options, plan the runs, start one worker process per run (or
per workload, or per backend), show a progress bar over the runs, keep to the time budget,
then work out the derived figures and write the report.
"""

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

from kmgpu.bench import derive, paths, plan, processes, report, workloads

BACKENDS = ("tensorflow", "jax", "torch")
# The default run ends within 10 minutes, the report written: runs whose guessed cost does
# not fit are skipped, and a worker still running when the budget less the report's
# reserve is spent is stopped, its runs said as stopped.
DEFAULT_BUDGET = 580


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
    p.add_argument("--workloads", default=None,
                   help="comma-separated, run in this order, from "
                        f"{','.join(workloads.BY_SIZE)} (default: "
                        f"{','.join(workloads.MODELS)}; with --quick all of them)")
    p.add_argument("--devices", default=None,
                   help="device counts, e.g. 1,2,4 (default: 1 to all)")
    p.add_argument("--policies", default=",".join(plan.POLICIES),
                   help="batch policies for N > 1 devices (default: %(default)s)")
    p.add_argument("--runners", default=",".join(plan.RUNNERS),
                   help="which runs, from %(default)s (plain fit is the reference of every "
                        "ratio)")
    p.add_argument("--lean", action="store_true",
                   help="leave out the peer's per_replica run (as --quick does): the peer "
                        "then runs at the top device count, global batch")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs per run (default: the workload's; at least 2: the first "
                        "includes compilation and is not in samples/s)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per epoch at the run's global batch (default: the workload's)")
    p.add_argument("--simulate", type=int, default=None,
                   help="simulated devices on a CPU-only machine (default: 2 with --quick "
                        "and no GPU, else none)")
    p.add_argument("--isolate", choices=("run", "workload", "backend"), default=None,
                   help="a fresh process for every run (fair first-epoch times, exact peak "
                        "memory; each run compiles its own), one per backend and workload "
                        "(default without --quick: plain fit, kmgpu, plain fit again in one "
                        "process, order-balanced; on JAX later runs load a program already "
                        "compiled from the compilation cache), or one per backend (default "
                        "with --quick)")
    p.add_argument("--replay", dest="replay", action="store_true", default=None,
                   help="run plain fit again after kmgpu (plain, kmgpu, plain): kmgpu / plain "
                        "fit compares kmgpu with the mean of both plain runs (order-balanced "
                        "where runs share a process), and the second run gives the "
                        "run-to-run noise of the timings and of parity; a row whose noise is "
                        "over 5%% is flagged, not judged (default: on; with a process per run "
                        "it comes after every workload's row)")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="one plain run before kmgpu: faster, but not order-balanced")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="seconds for the whole command: a workload's runs on a backend that "
                        "would not fit are skipped whole (said, and marked in the report); "
                        "0: no limit (default: %(default)s)")
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
    started = time.monotonic()  # the budget counts from the command's start
    args = parse(argv)
    out = args.out or paths.default_out()
    if args.report:
        return _merge_only(args, out, argv)
    names = _split(args.workloads or ",".join(
        workloads.BY_SIZE if args.quick else workloads.MODELS))
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
    gpus = [gpus[i] for i in processes.visible(child_env, len(gpus), visible_gpu_indices)]
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
    isolate = args.isolate or ("backend" if args.quick else "workload")
    name = args.name or ((slug(gpus[0]) + f"-x{len(gpus)}") if gpus else
                         f"cpu-sim{simulate}" if simulate else "cpu") + \
        ("-quick" if args.quick else "")
    replay = True if args.replay is None else args.replay
    units = plan.units(backends, names, counts, replay, _split(args.policies),
                       _split(args.runners), lean=args.quick or args.lean,
                       shared=isolate != "run")
    runs = [r for u in units for r in u["runs"]]
    top = max(counts)
    seconds = args.budget or None

    import keras

    no_plot = report.plot_missing()
    print(f"kmgpu bench: {len(runs)} runs ({', '.join(backends)}; {', '.join(names)}; "
          f"devices {counts}{'; simulated' if simulate else ''}; one process per {isolate}"
          + (f"; budget {seconds:.0f} s" if seconds else "; no time budget")
          + f") -> {os.path.join(out, name)}.{{json,md{'' if no_plot else ',png'},log}}",
          flush=True)
    if no_plot:
        print(f"kmgpu bench: no plot ({no_plot})", flush=True)
    if simulate:
        print(f"kmgpu bench: the {simulate} simulated devices share this machine's "
              f"{os.cpu_count()} CPU core(s): the figures test the code, they are not "
              "speedups.", flush=True)
    # A terminal gets the redrawn bar; a log (a GPU job's output) one line per run and the
    # bar's last line, without colour codes or redraws.
    tty = sys.stdout.isatty()
    bar = keras.utils.Progbar(len(runs), verbose=1 if tty else 2)
    counter = {"done": 0, "failed": 0, "skipped": 0}
    results = {
        "name": name, "quick": args.quick, "isolate": isolate, "simulate": simulate,
        "replay": replay, "devices": counts, "lean": args.quick or args.lean,
        "budget": seconds,
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
    # kept for the report: the plot and tables take seconds (a full run's, more)
    budget = plan.Budget(seconds, reserve=5.0 if args.quick else 15.0,
                         prior=workloads.prior_seconds(args.quick, bool(gpus)))
    budget.started = started
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, name + ".log")

    def finished(rec):
        rec.pop("kind", None)
        results["runs"].append(rec)
        counter["done"] += 1
        counter["failed"] += rec["status"] == "error"
        counter["skipped"] += rec["status"] == "skipped"
        # The counts ride in the unit's name: Progbar would print values as floats.
        bar.unit_name = f"run - failed: {counter['failed']} - skipped: {counter['skipped']}"
        if not tty:
            print(f"  [{counter['done']}/{len(runs)}] {_one_line(rec)}", flush=True)
        bar.update(counter["done"])
        _save_partial(results, out)

    spec = {"quick": args.quick, "simulate": simulate, "max_devices": top,
            "epochs": args.epochs, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="kmgpu-bench-") as tmp, plain_log(log_path) as log:
        if args.quick or isolate != "run":  # JAX: runs of one program share its compiled
            # code: a later run loads what an earlier one compiled and autotuned, so plain
            # fit and kmgpu run the same kernels where their programs are the same
            spec["jax_cache"] = os.path.join(tmp, "jax-cache")
        running = {}  # backend: its worker process, kept while runs may share it

        def worker(backend):
            if backend not in running or not running[backend].alive():
                wdir = os.path.join(tmp, backend)
                os.makedirs(wdir, exist_ok=True)
                env = processes.environment(child_env, backend, quick_cpu=args.quick and not gpus)
                running[backend] = processes.Worker(backend, dict(spec, weights_dir=wdir), env,
                                                  log, tmp)
            return running[backend]

        def record(rec):
            if rec.get("kind") == "env":
                info = backends_info.setdefault(rec["backend"], {"status": "ok"})
                info.update({k: v for k, v in rec.items() if k != "kind"})
                info["peer_name"] = derive.peer_name(rec["backend"])
            else:
                finished(rec)

        try:
            for unit, why in plan.Scheduler(units, budget):
                backend = unit["backend"]
                if why:
                    line, records = plan.skipped(unit, why)
                    print(("\n" if tty else "") + f"kmgpu bench: {line}", flush=True)
                    for rec in records:
                        finished(rec)
                    continue
                for batch in ([[r] for r in unit["runs"]] if isolate == "run"
                              else [unit["runs"]]):
                    left = budget.left()
                    by_budget = left is not None and (args.timeout is None or left < args.timeout)
                    timeout = left if by_budget else (args.timeout or float("inf"))
                    for rec in worker(backend).run(batch, timeout, budget, by_budget):
                        record(rec)
                    if isolate != "backend":
                        running.pop(backend).close()
        finally:
            for w in running.values():
                w.close()
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


@contextlib.contextmanager
def plain_log(path):
    """The workers' log file; once closed (also when the command is stopped), without
    terminal control codes: colours, and a progress bar's redraws (each line keeps the
    text after its last carriage return)."""
    try:
        with open(path, "w") as log:
            yield log
    finally:
        with open(path, errors="replace", newline="") as f:
            text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f.read()).replace("\b", "")
        lines = ([p for p in line.split("\r") if p.strip()] for line in text.split("\n"))
        with open(path, "w") as f:
            f.write("\n".join(parts[-1] if parts else "" for parts in lines))


def _one_line(r):
    what = (f"{r['backend']} {r['workload']} {r['runner']} N={r['devices']} "
            f"{r.get('policy', 'global')}")
    if r["status"] != "ok":
        return f"{what}: {r['status']}: {r.get('error') or r.get('reason')}"
    if r["runner"] == "allreduce":
        return f"{what}: {len(r['points'])} sizes, busbw {(r.get('busbw') or 0) / 1e9:.1f} GB/s"
    return (f"{what}: {r['samples_per_s']:,.0f} samples/s, 1st epoch {r['first_epoch_s']:.1f} s, "
            f"wall {r.get('wall_s', 0):.0f} s")


def _finish(results, written, log_path=None):
    from kmgpu.bench import summary

    failed = [r for r in results["runs"] if r["status"] == "error"]
    if failed:
        print(f"{len(failed)} run(s) failed" + (f" (details in {log_path})" if log_path else "")
              + ":")
        for r in failed:
            print(f"  {r['backend']} {r['workload']} {r['runner']} N={r['devices']} "
                  f"{r.get('policy', 'global')}: {r.get('error')}")
    skipped = [r for r in results["runs"] if r["status"] == "skipped"]
    if skipped:  # one line per workload and backend
        why = {}
        for r in skipped:
            why.setdefault((r["workload"], r["backend"]), r.get("reason", "?"))
        print(f"{len(skipped)} run(s) skipped:")
        for (workload, backend), reason in why.items():
            print(f"  {workload} on {backend}: {reason}")
    no_plot = report.plot_missing()
    print("\nwrote " + ", ".join(written) + (f" (no plot: {no_plot})" if no_plot else "")
          + "\n")
    print(report.comparison_table(results))
    print()
    print(report.COMPARISON_LEGEND)
    print()
    if report.tables.top_devices(results) > 1:
        print(report.headline(results))
        print()
        print(report.tables.legend(results))
        print()
    print(summary.LEGEND)  # the table users read first comes last: the end of a log
    print()
    notes = summary.noise_notes(results)  # why its rows not judged are, just above it
    if notes:
        print("\n".join(notes))
        print()
    print(summary.table(results))


def _merge_only(args, out, argv):
    merged = report.merge([report.load(p) for p in args.report])
    merged["name"] = args.name or merged["name"]
    merged["projection"].update(projection_params(args))
    merged["command"] = ["kmgpu", "bench"] + argv
    derive.derive(merged)
    _finish(merged, report.write(merged, out))
    return 0


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

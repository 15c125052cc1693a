"""How scripts/test.sh splits the suite over its lanes: one job (one pytest process) per
part of a backend's files, the parts balanced by the seconds each file took last time.

The files of a backend are tests/unit, tests/common and tests/<backend> (test_*.py, found
here, so a new file is in the next run); a file's weight is its line in
scripts/test_times.txt (measured: ``bash scripts/test.sh --save-times``), or DEFAULT_S
for a file not measured yet. Each backend's files are cut into parts of about equal
weight (longest first, each to the lightest part), but for the files of DEFAULT_COMPILE,
a part of their own ("default"); the jobs are printed heaviest first,
one a line: ``<backend> <part> <seconds> <file> ...``. The lanes take them in that order
as they get free, so the longest go first and the short ones fill in.

How many parts: ``--parts N`` for every backend, or (the default) for each backend the
count that makes the ``--lanes`` end soonest, the lanes' run played out with each job's
weight plus START_S, and of ends within NEAR of the soonest the plan whose heaviest job is
lightest (a job that runs long then delays the end least): a job's time beside another
varies by tens of percent from its measured weight, so a plan of a few long jobs cannot
even out what it did not foresee, and an odd number of equal jobs leaves one lane a whole
job later than the other.
"""

import argparse
import glob
import heapq
import itertools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = os.path.join(ROOT, "scripts", "test_times.txt")
DEFAULT_S = 30.0  # a file not measured yet
START_S = 12.0  # a pytest process's own start and end (imports, collection, exit), per job
MAX_PARTS = 4  # per backend, when the count is chosen
NEAR = 0.03  # ends this close to the soonest count as equal
#: files whose parity needs the compile users get, each backend's in a part of its own
#: named "default" (scripts/test.sh compiles every other JAX part fast, at LLVM level 0,
#: where XLA's CPU reductions keep their written order: a one-device reference's sum over
#: the batch then differs from the replicas' partial sums by more than the vectorised
#: sums of the default level do, and test_copy_back's Adam on a 4096-wide layer carries
#: that past its 1e-5 parity)
DEFAULT_COMPILE = {"jax": ("tests/jax/test_copy_back.py",)}


def files(backend):
    found = []
    for folder in ("unit", "common", backend):
        found += sorted(glob.glob(os.path.join(ROOT, "tests", folder, "test_*.py")))
    return [os.path.relpath(f, ROOT) for f in found]


def times(path=TIMES):
    """{(backend, file): seconds} from the times file ("backend file seconds" lines)."""
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and not line.startswith("#"):
                    out[(parts[0], parts[1])] = float(parts[2])
    return out


def split(weights, parts):
    """Cut {file: seconds} into ``parts`` lists of about equal total (longest first,
    each to the lightest part so far); empty parts are dropped."""
    bins = [[0.0, []] for _ in range(max(1, parts))]
    for name, w in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])):
        lightest = min(bins, key=lambda b: b[0])
        lightest[0] += w
        lightest[1].append(name)
    return [(total, sorted(names)) for total, names in bins if names]


def jobs_of(backends, parts, known):
    """The jobs for ``parts`` = {backend: count}, heaviest first."""
    jobs = []
    for backend in backends:
        own = [f for f in files(backend) if f in DEFAULT_COMPILE.get(backend, ())]
        weights = {f: known.get((backend, f), DEFAULT_S) for f in files(backend)
                   if f not in own}
        for i, (total, names) in enumerate(split(weights, parts[backend])):
            jobs.append((total + START_S, backend, i + 1, names))
        if own:
            total = sum(known.get((backend, f), DEFAULT_S) for f in own)
            jobs.append((total + START_S, backend, "default", own))
    return sorted(jobs, key=lambda j: -j[0])


def lanes_end(jobs, lanes):
    """When the last of ``lanes`` lanes ends, each taking the next job (in order) as it
    gets free (xargs -P in scripts/test.sh)."""
    ends = [0.0] * max(1, lanes)
    for seconds, *_ in jobs:
        heapq.heapreplace(ends, ends[0] + seconds)
    return max(ends)


def plan(backends, parts=None, known=None, lanes=2):
    """The jobs: ``parts`` per backend, or (None) the counts that end the lanes soonest."""
    known = times() if known is None else known
    if parts:
        return jobs_of(backends, dict.fromkeys(backends, parts), known)
    plans = []
    for counts in itertools.product(range(1, MAX_PARTS + 1), repeat=len(backends)):
        jobs = jobs_of(backends, dict(zip(backends, counts)), known)
        plans.append((lanes_end(jobs, lanes), jobs[0][0], len(jobs), jobs))  # end, heaviest
    soonest = min(p[0] for p in plans)
    # of the plans within NEAR of the soonest end, the one with the lightest heaviest job:
    # a job that runs longer than measured then delays the end the least
    near = [p for p in plans if p[0] <= soonest * (1 + NEAR)]
    return min(near, key=lambda p: (p[1], p[0], p[2]))[3]


def save(logs, backends, path=TIMES):
    """Write the seconds per file from the --file-progress lines of a run's logs."""
    import re

    known = times(path)
    for log in glob.glob(os.path.join(logs, "*.log")):
        backend = os.path.basename(log).split(".")[0]
        if backend not in backends:
            continue
        with open(log, errors="replace") as f:
            for line in f:
                m = re.match(r"^(tests/\S+\.py): .* in (\d+) s \(", line)
                if m:
                    known[(backend, m.group(1))] = float(m.group(2))
    with open(path, "w") as f:
        f.write("# seconds per test file and backend, from --file-progress (scripts/test.sh "
                "--save-times);\n# scripts/test_plan.py balances the lanes by them\n")
        for (backend, name), s in sorted(known.items()):
            if os.path.exists(os.path.join(ROOT, name)):
                f.write(f"{backend} {name} {s:.0f}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("backends", nargs="+")
    p.add_argument("--parts", type=int, default=0,
                   help="jobs per backend (default: the counts that end the lanes soonest)")
    p.add_argument("--lanes", type=int, default=2, help="jobs at once (scripts/test.sh)")
    p.add_argument("--save", metavar="LOGS", help="write test_times.txt from these logs")
    args = p.parse_args(argv)
    if args.save:
        save(args.save, args.backends)
        return 0
    for seconds, backend, part, names in plan(args.backends, args.parts, lanes=args.lanes):
        print(backend, part, f"{seconds:.0f}", " ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How scripts/test.sh splits the suite over its lanes: one job (one pytest process) per
part of a backend's files, the parts balanced by the seconds each file took last time.

The files of a backend are tests/unit, tests/common and tests/<backend> (test_*.py, found
here, so a new file is in the next run); a file's weight is its line in
scripts/test_times.txt (measured: ``bash scripts/test.sh --save-times``), or DEFAULT_S
for a file not measured yet. Each backend's files are cut into ``--parts`` parts of
about equal weight (longest first, each to the lightest part); the jobs are printed
heaviest first, one a line: ``<backend> <part> <seconds> <file> ...``. The lanes take
them in that order as they get free, so the longest go first and the short ones fill in.
"""

import argparse
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = os.path.join(ROOT, "scripts", "test_times.txt")
DEFAULT_S = 30.0  # a file not measured yet
START_S = 8.0  # a pytest process's own start (imports, simulated devices), per job


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


def plan(backends, parts, known=None):
    known = times() if known is None else known
    jobs = []
    for backend in backends:
        weights = {f: known.get((backend, f), DEFAULT_S) for f in files(backend)}
        for i, (total, names) in enumerate(split(weights, parts)):
            jobs.append((total + START_S, backend, i + 1, names))
    return sorted(jobs, key=lambda j: -j[0])


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
    p.add_argument("--parts", type=int, default=2, help="jobs per backend")
    p.add_argument("--save", metavar="LOGS", help="write test_times.txt from these logs")
    args = p.parse_args(argv)
    if args.save:
        save(args.save, args.backends)
        return 0
    for seconds, backend, part, names in plan(args.backends, args.parts):
        print(backend, part, f"{seconds:.0f}", " ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

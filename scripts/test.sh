#!/usr/bin/env bash
# Set up a virtual environment (if needed) and run the test suite, one process per
# Keras backend and part: tests/unit, tests/common and tests/<backend> run under
# KERAS_BACKEND=<backend>. Each backend's files are cut into parts of about equal
# measured time (scripts/test_plan.py, scripts/test_times.txt; a new file counts 30 s
# until measured), as many per backend as end the lanes soonest (KMGPU_TEST_PARTS=N: N
# each), and two lanes take the parts heaviest first as they get free, so both cores stay
# busy to the end. `kmgpu bench --quick` runs once per suite, for every
# backend, in one session (KMGPU_BENCH_SMOKE), and the backend-neutral tests in one
# backend's sessions (KMGPU_NEUTRAL_IN). Each line of progress (one per finished
# test file, tests/conftest.py --file-progress) is printed as it comes, prefixed with
# its backend and part; the summary comes last.
# KMGPU_TEST_SERIAL=1 runs the parts one after the other; KMGPU_TEST_LANES=N runs N.
# Usage: bash scripts/test.sh [--save-times] [backend ...] [-- extra pytest args]
#   --save-times: afterwards, write each file's seconds to scripts/test_times.txt
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
save=0
[ "${1:-}" = "--save-times" ] && { save=1; shift; }
backends=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do backends+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#backends[@]} -gt 0 ] || backends=(tensorflow jax torch)
export KMGPU_TEST_ARGS=$([ $# -eq 0 ] || printf "%q " "$@")  # quoted: job() evals it (none: empty, not '')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
export KMGPU_TEST_LOGS=$logs
lanes=${KMGPU_TEST_LANES:-2}
[ "${KMGPU_TEST_SERIAL:-0}" = 1 ] && lanes=1
# one compute thread per JAX / torch session when lanes run side by side: the lanes fill
# the cores, and tiny models gain nothing from a thread pool, which under contention made a
# test file 2-3x slower (A/B: JAX test_faults alone 11-12 s either way; beside another busy
# process 11-12 s with one thread, 12-25 s with the default pools). Not for TensorFlow: with
# one intra-op thread its 4-replica MirroredStrategy sessions aborted inside evaluate
# (Keras's epoch_iterator.reset, "Fatal Python error: Aborted") twice in three full runs.
# Set them yourself to override.
single_thread() {
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
  case " ${XLA_FLAGS:-} " in
    *xla_cpu_multi_thread_eigen*) ;;
    *) export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false" ;;
  esac
}
export -f single_thread
# JAX sessions compile with LLVM's optimisation level 0, not 2: the tests' programs are tiny
# and distinct, so compiling them is most of JAX's time, and level 0 compiles fastest. At
# level 0 LLVM leaves XLA's CPU reductions in their written order,
# and a parity check that needs the vectorised order users' programs get runs in a part of
# its own, compiled as theirs are (scripts/test_plan.py, DEFAULT_COMPILE). Set it yourself
# to override.
fast_compile() {
  case " ${XLA_FLAGS:-} " in
    *xla_backend_optimization_level*) ;;
    *) export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0" ;;
  esac
}
export -f fast_compile
export KMGPU_TEST_LANES_ON=$lanes
# the quick bench: once, for every backend of this run, in the last backend's sessions
export KMGPU_BENCH_SMOKE_ALL=$(IFS=,; echo "${backends[*]}") KMGPU_BENCH_SMOKE_IN=${backends[-1]}
# the backend-neutral tests (pytest.mark.backend_neutral: they read only kmgpu's and
# Keras's files): once, in JAX's sessions where JAX runs, else in the first backend's
export KMGPU_NEUTRAL_IN=${backends[0]}
for b in "${backends[@]}"; do [ "$b" = jax ] && KMGPU_NEUTRAL_IN=jax; done

job() {  # "backend part seconds file ...": one pytest session, its lines prefixed
  set -- $1
  local b=$1 part=$2 est=$3 s=$SECONDS rc smoke=""
  shift 3
  local files=$#
  eval "set -- \"\$@\" $KMGPU_TEST_ARGS"
  [ "$b" = "$KMGPU_BENCH_SMOKE_IN" ] && smoke=$KMGPU_BENCH_SMOKE_ALL
  [ "$KMGPU_TEST_LANES_ON" -gt 1 ] && [ "$b" != tensorflow ] && single_thread
  [ "$b" = jax ] && [ "$part" != default ] && fast_compile
  echo "[$b.$part] started: ${files} files (about $est s)"
  # a pipeline, not a process substitution: that would be a child of pytest itself,
  # which the tests that count their child processes would see
  # --file-progress (tests/conftest.py): a line per finished test file, not a dot per test
  KMGPU_BENCH_SMOKE=$smoke KERAS_BACKEND=$b PYTHONUNBUFFERED=1 python -m pytest -q \
    -p no:cacheprovider --file-progress -o console_output_style=classic \
    "$@" 2>&1 | tee "$KMGPU_TEST_LOGS/$b.$part.log" | sed -u "s/^/[$b.$part] /"
  rc=${PIPESTATUS[0]}
  echo "[$b.$part] done after $((SECONDS - s)) s (exit $rc)"
  [ "$rc" = 0 ] || [ "$rc" = 5 ]  # 5: every test of the part deselected by -k / -m
}
export -f job

start=$SECONDS
status=0
python scripts/test_plan.py --parts "${KMGPU_TEST_PARTS:-0}" --lanes "$lanes" "${backends[@]}" > "$logs/jobs" || exit 1
xargs -a "$logs/jobs" -d '\n' -P "$lanes" -I{} bash -c 'job "$1"' _ {} || status=1
echo "=== summary ($((SECONDS - start)) s)"
passed=0 failed=0 skipped=0
for b in "${backends[@]}"; do
  bp=0 bf=0 bs=0 parts=0
  for log in "$logs/$b".*.log; do
    [ -e "$log" ] || continue
    parts=$((parts + 1))
    line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$log" | tail -1)
    [ -n "$line" ] || { echo "KERAS_BACKEND=$b: no pytest summary in $(basename "$log") (crashed?)"; status=1; }
    n=$(grep -oE "[0-9]+ passed" <<<"$line" | grep -oE "^[0-9]+" || true); bp=$((bp + ${n:-0}))
    n=$(grep -oE "[0-9]+ failed" <<<"$line" | grep -oE "^[0-9]+" || true); bf=$((bf + ${n:-0}))
    n=$(grep -oE "[0-9]+ errors?" <<<"$line" | grep -oE "^[0-9]+" || true); bf=$((bf + ${n:-0}))
    n=$(grep -oE "[0-9]+ skipped" <<<"$line" | grep -oE "^[0-9]+" || true); bs=$((bs + ${n:-0}))
  done
  echo "KERAS_BACKEND=$b: $bp passed, $bf failed, $bs skipped ($parts parts)"
  [ "$parts" -gt 0 ] || status=1
  passed=$((passed + bp)) failed=$((failed + bf)) skipped=$((skipped + bs))
done
echo "all backends: $passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ] || status=1
if [ "$save" = 1 ]; then
  python scripts/test_plan.py --save "$logs" "${backends[@]}" && echo "wrote scripts/test_times.txt"
fi
exit $status

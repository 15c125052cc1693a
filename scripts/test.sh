#!/usr/bin/env bash
# Set up a virtual environment (if needed) and run the test suite, one process per
# Keras backend: tests/unit, tests/common and tests/<backend> run under
# KERAS_BACKEND=<backend>. About 20 minutes on an idle 2-core machine (1,189 s, 731 tests,
# measured in a fresh clone), plus a few minutes to make .venv the first time. With
# several backends the sessions run in two lanes side by side (the suite is ~1,800
# CPU-seconds; one session leaves the second core mostly idle); each line of progress
# (one per finished test file, tests/conftest.py --file-progress) is printed as it comes,
# prefixed with its backend; about 105 lines in all, the summary last.
# KMGPU_TEST_SERIAL=1 runs them one after the other.
# Usage: bash scripts/test.sh [backend ...] [-- extra pytest args]
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
backends=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do backends+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#backends[@]} -gt 0 ] || backends=(tensorflow jax torch)
pytest_args=("$@")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run() {  # backend: one pytest session, its lines prefixed "[backend] " as they come
  local b=$1 s=$SECONDS rc
  echo "[$b] started: tests/unit tests/common tests/$b"
  # a pipeline, not a process substitution: that would be a child of pytest itself,
  # which the tests that count their child processes would see
  # --file-progress (tests/conftest.py): a line per finished test file, not a dot per test
  KERAS_BACKEND=$b PYTHONUNBUFFERED=1 python -m pytest -q -p no:cacheprovider \
    --file-progress -o console_output_style=classic \
    tests/unit tests/common "tests/$b" "${pytest_args[@]}" 2>&1 | tee "$logs/$b.log" \
    | sed -u "s/^/[$b] /"
  rc=${PIPESTATUS[0]}
  echo "[$b] done after $((SECONDS - s)) s (exit $rc)"
  return $rc
}
lane() {  # backend ...: one after the other
  local b rc=0
  for b in "$@"; do run "$b" || rc=1; done
  return $rc
}

start=$SECONDS
status=0
if [ "${KMGPU_TEST_SERIAL:-0}" = 1 ] || [ ${#backends[@]} -eq 1 ]; then
  lane "${backends[@]}" || status=1
else  # TensorFlow (the longest session) in one lane, the others in the second
  lane "${backends[0]}" & first=$!
  lane "${backends[@]:1}" || status=1
  wait $first || status=1
fi
echo "=== summary ($((SECONDS - start)) s)"
passed=0 failed=0 skipped=0
for b in "${backends[@]}"; do
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$logs/$b.log" | tail -1)
  echo "KERAS_BACKEND=$b: ${line:-no pytest summary (crashed?)}"
  [ -n "$line" ] || status=1
  for key in passed failed skipped; do
    n=$(grep -oE "[0-9]+ $key" <<<"$line" | grep -oE "^[0-9]+" || true)
    n=${n:-0}
    eval "$key=\$(( $key + n ))"
  done
  e=$(grep -oE "[0-9]+ errors?" <<<"$line" | grep -oE "^[0-9]+" || true)
  failed=$((failed + ${e:-0}))
done
echo "all backends: $passed passed, $failed failed, $skipped skipped"
exit $status

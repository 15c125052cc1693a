#!/usr/bin/env bash
# Set up a virtual environment (if needed) and run the test suite, one process per
# Keras backend: tests/common and tests/<backend> run under KERAS_BACKEND=<backend>.
# With several backends the sessions run in two lanes side by side (the suite is
# about 580 CPU-seconds; one session leaves the second core mostly idle).
# KMGPU_TEST_SERIAL=1 runs them one after the other, printing as they go.
# Usage: bash scripts/test.sh [backend ...] [-- extra pytest args]
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
backends=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do backends+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#backends[@]} -gt 0 ] || backends=(tensorflow jax torch)

run() {  # backend [pytest args]
  local b=$1; shift
  KERAS_BACKEND=$b python -m pytest -q -p no:cacheprovider tests/unit tests/common "tests/$b" "$@"
}

status=0
if [ "${KMGPU_TEST_SERIAL:-0}" = 1 ] || [ ${#backends[@]} -eq 1 ]; then
  for b in "${backends[@]}"; do
    echo "=== KERAS_BACKEND=$b"
    run "$b" "$@" || status=1
  done
  exit $status
fi

# Two lanes for two cores: TensorFlow (the longest session) in one, the others one
# after the other in the second. Each session's output follows when it ends.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$SECONDS
lane() {  # backend ...: run them one after the other, each into its log
  local b s rc=0
  for b in "$@"; do
    s=$SECONDS
    run "$b" "${pytest_args[@]}" > "$logs/$b.log" 2>&1 || rc=1
    echo "=== KERAS_BACKEND=$b: done after $((SECONDS - s)) s" >> "$logs/$b.log"
  done
  return $rc
}
pytest_args=("$@")
first=${backends[0]}
lane "$first" & first_pid=$!
lane "${backends[@]:1}" || status=1
wait $first_pid || status=1
for b in "${backends[@]}"; do
  echo "=== KERAS_BACKEND=$b"
  cat "$logs/$b.log"
done
echo "=== all backends: $((SECONDS - start)) s, exit $status"
exit $status

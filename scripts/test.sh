#!/usr/bin/env bash
# Set up a virtual environment (if needed) and run the test suite, one process per
# Keras backend: tests/common and tests/<backend> run under KERAS_BACKEND=<backend>.
# Usage: bash scripts/test.sh [backend ...] [-- extra pytest args]
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
backends=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do backends+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#backends[@]} -gt 0 ] || backends=(tensorflow jax torch)
status=0
for b in "${backends[@]}"; do
  echo "=== KERAS_BACKEND=$b"
  KERAS_BACKEND=$b python -m pytest -q -p no:cacheprovider tests/common "tests/$b" "$@" || status=1
done
exit $status

#!/usr/bin/env bash
# Set up .venv (if needed) and run `kmgpu demo` with the given options.
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
exec kmgpu demo "$@"

#!/usr/bin/env bash
# Execute the notebooks as CI does (CPU, simulated devices, each in a fresh kernel that
# chooses its own backend) and save them with their outputs, so a reader on a code host
# sees the tables, plots and timings; says so if an output holds a path of this machine
# (tests/common/test_notebooks.py refuses those). About 2 minutes on 2 cores.
# Usage: bash scripts/notebooks.sh [notebooks/NAME.ipynb ...]   (default: every notebook)
set -u
cd "$(dirname "$0")/.."
. scripts/setup.sh
exec python -m tests.common.test_notebooks "$@"

#!/usr/bin/env bash
# The Keras-internal set on another Keras than .venv's: the tests that touch Keras's
# internals (every Keras-patch row's name and behaviour: tests/unit and
# tests/<backend>/test_keras_behaviour.py; parity, script features, stateful RNNs,
# outside weights, masked and own losses, torch's captured step), one pytest process per
# backend, two at a time (KMGPU_TEST_LANES=N: N), in a virtual environment of its own
# with .venv's TensorFlow, JAX and torch (the pinned CPU torch first: an unpinned one
# pulls CUDA).
#
#   bash scripts/test_keras.sh oldest            # the lower bound of pyproject.toml's range (CI)
#   bash scripts/test_keras.sh 3.14.1            # a Keras release
#   bash scripts/test_keras.sh master [SOURCE]   # Keras's next release, from its source:
#       SOURCE is a checkout of github.com/keras-team/keras or anything pip installs
#       (default git+https://github.com/keras-team/keras.git, which needs the network)
#   ... [-- extra pytest args]
#
# The environment is .venv-keras-<which> (KMGPU_KERAS_VENV=path for another), kept for the
# next run; a release already installed there is not installed again, master always is.
# A Keras outside pyproject.toml's range (master) runs with kmgpu's once-per-process
# warning silenced and test_the_installed_keras_is_inside_the_declared_range deselected.
set -u
cd "$(dirname "$0")/.."
which=${1:-oldest}
[ $# -gt 0 ] && shift
source=""
if [ "$which" = master ]; then
  source=git+https://github.com/keras-team/keras.git
  [ $# -gt 0 ] && [ "$1" != "--" ] && { source=$1; shift; }
fi
[ "${1:-}" = "--" ] && shift
[ -x .venv/bin/python ] || ( . scripts/setup.sh ) || exit 1  # .venv: scripts/test.sh's

range=$(.venv/bin/python -c 'import tomllib, re
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if re.match(r"keras\s*[<>=!]", d))[5:].replace(" ", ""))')
if [ "$which" = oldest ]; then
  which=$(sed -nE 's/.*>=([0-9.]+).*/\1/p' <<<"$range")
  [ -n "$which" ] || { echo "no lower bound in keras$range"; exit 1; }
  [[ $which =~ ^[0-9]+\.[0-9]+$ ]] && which=$which.0  # 3.14: the release 3.14.0
fi
venv=${KMGPU_KERAS_VENV:-.venv-keras-$which}
py=$venv/bin/python
start=$SECONDS

# -- the environment ---------------------------------------------------------------------
# Keras's version read, not imported: importing Keras imports its backend
version='import importlib.metadata as m; print(m.version("keras"))'
if ! "$py" scripts/installed.py kmgpu tensorflow jax torch cloudpickle pytest 2>/dev/null; then
  echo "kmgpu: making $venv (.venv's TensorFlow, JAX and torch; a few minutes) ..."
  .venv/bin/python -m venv "$venv" || exit 1  # .venv's Python
  torch=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  "$py" -m pip install -q "torch==$torch" || exit 1
  # every other package at .venv's version; keras and kmgpu come below
  .venv/bin/python -m pip freeze --exclude-editable \
    | grep -viE '^(keras|kmgpu|torch)==| @ ' > "$venv/constraints.txt"
  "$py" -m pip install -q -c "$venv/constraints.txt" tensorflow-cpu jax cloudpickle numpy \
    pytest hypothesis || exit 1
  "$py" -m pip install -q --no-deps -e . || exit 1
fi
if [ -n "$source" ]; then
  echo "kmgpu: installing Keras from $source ..."
  "$py" -m pip install -q --no-deps --force-reinstall "$source" || exit 1
  # its own dependencies (absl, rich, namex, ...), at .venv's versions where .venv has them
  "$py" -m pip install -q -c "$venv/constraints.txt" absl-py numpy rich namex h5py optree \
    ml-dtypes packaging || exit 1
elif [ "$("$py" -c "$version" 2>/dev/null)" != "$which" ]; then
  echo "kmgpu: installing keras==$which ..."
  "$py" -m pip install -q -c "$venv/constraints.txt" "keras==$which" || exit 1
fi
keras=$("$py" -c "$version" 2>/dev/null) || exit 1
echo "kmgpu: Keras $keras in $venv ($((SECONDS - start)) s); pyproject.toml declares keras$range"

# -- the set -----------------------------------------------------------------------------
outside=()
if ! "$py" -c "import sys; from kmgpu import versions
sys.exit(0 if versions.in_range('$keras', '$range') else 1)"; then
  outside=(-W "ignore::UserWarning:kmgpu.versions"
           --deselect tests/unit/test_structure.py::test_the_installed_keras_is_inside_the_declared_range)
  echo "kmgpu: Keras $keras is outside keras$range: its warning silenced, the range test deselected"
fi
args=("${outside[@]}" "$@")
# quoted, for set_job to eval (none: empty, not '', which pytest would read as ".")
export KMGPU_SET_PY=$py KMGPU_SET_ARGS=$([ ${#args[@]} -eq 0 ] || printf "%q " "${args[@]}")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
export KMGPU_SET_LOGS=$logs TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

set_job() {  # one backend: one pytest session, its lines prefixed
  local b=$1 s=$SECONDS rc
  local files=(tests/unit tests/common/test_api.py tests/common/test_parity.py
               tests/common/test_script_features.py tests/common/test_stateful.py
               tests/common/test_outside_weights.py tests/common/test_masked_losses.py
               "tests/$b/test_keras_behaviour.py")
  [ "$b" = torch ] && files+=(tests/torch/test_captured_step.py)
  eval "set -- $KMGPU_SET_ARGS"
  # one compute thread for JAX and torch beside another session (as scripts/test.sh)
  if [ "$b" != tensorflow ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false"
  fi
  echo "[$b] started"
  KERAS_BACKEND=$b PYTHONUNBUFFERED=1 "$KMGPU_SET_PY" -m pytest -q -p no:cacheprovider \
    --file-progress -o console_output_style=classic "${files[@]}" "$@" 2>&1 \
    | tee "$KMGPU_SET_LOGS/$b.log" | sed -u "s/^/[$b] /"
  rc=${PIPESTATUS[0]}
  echo "[$b] done after $((SECONDS - s)) s (exit $rc)"
  [ "$rc" = 0 ]
}
export -f set_job

status=0
lanes=${KMGPU_TEST_LANES:-2}  # as scripts/test.sh: sessions side by side
printf '%s\n' tensorflow jax torch | xargs -P "$lanes" -I{} bash -c 'set_job "$1"' _ {} \
  || status=1
echo "=== Keras $keras: summary ($((SECONDS - start)) s in all)"
for b in tensorflow jax torch; do
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$logs/$b.log" | tail -1)
  echo "KERAS_BACKEND=$b: ${line:-no pytest summary (crashed?)}"
  [ -n "$line" ] || status=1
done
exit $status

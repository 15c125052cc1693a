# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with kmgpu and all three
# backends. The pinned CPU build of torch goes first: an unpinned torch pulls CUDA.
if [ ! -x .venv/bin/python ]; then
  echo "kmgpu: first run - creating .venv with kmgpu, TensorFlow, JAX and torch (a few minutes)..."
  python3 -m venv .venv || exit 1
fi
. .venv/bin/activate
if ! python scripts/installed.py \
    kmgpu keras tensorflow jax torch cloudpickle pytest nbclient matplotlib pynvml hypothesis \
    sybil mkdocs material mkdocstrings mkdocstrings_handlers.python keras_hub tensorflow_text 2>/dev/null; then
  echo "kmgpu: installing torch==2.13.0 (CPU build) ..."
  python -m pip install -q torch==2.13.0 || exit 1
  echo "kmgpu: installing kmgpu[all,test] (keras, tensorflow-cpu, jax, ...) ..."
  python -m pip install -q -e ".[all,test]" || exit 1
  echo "kmgpu: .venv ready."
fi
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

"""Exit 0 when every package named on the command line is installed, 1 otherwise.

The packages are found (``importlib.util.find_spec``), not imported: importing Keras
imports its backend, and importing the three backends costs seconds of CPU, which
scripts/setup.sh and scripts/test_keras.sh would pay before every run.

    python scripts/installed.py kmgpu keras tensorflow jax torch
"""

import importlib.util
import sys



def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a submodule's parent package is missing
        return False


sys.exit(0 if all(map(found, sys.argv[1:])) else 1)

"""The Keras releases kmgpu is tested with, and the one warning when another one runs.

The range is ``KERAS`` of ``kmgpu/engines/keras_fixes.py`` (each backend's registry has
the same): the Keras releases every ``PATCHES`` row was checked against, and
``pyproject.toml``'s ``dependencies`` allow (``tests/unit/test_structure.py`` keeps the
three alike). Outside it kmgpu still runs: a new Keras that changes what a patch relies
on fails that patch's behaviour test (``tests/unit/test_keras_behaviour.py``), not a
version guard.
"""

import threading
import warnings

from kmgpu.engines import keras_fixes

_OPS = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}
_LOCK = threading.Lock()
_warned = False


def release(version):
    """The release numbers of a version string, padded to three: ``"3.16.0.dev2026"`` ->
    ``(3, 16, 0)``, ``"3.14"`` -> ``(3, 14, 0)``. A pre-release counts as its release,
    which ``<3.16`` leaves out (as pip does)."""
    numbers = []
    for part in str(version).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:
            break
    return tuple((numbers + [0, 0, 0])[:3])


def in_range(version, spec=None):
    """Whether ``version`` satisfies ``spec`` (comma-separated clauses such as
    ``">=3.14,<3.16"``; by default the tested range)."""
    spec = keras_fixes.KERAS if spec is None else spec
    have = release(version)
    for clause in spec.split(","):
        clause = clause.strip()
        op = next(o for o in sorted(_OPS, key=len, reverse=True) if clause.startswith(o))
        if not _OPS[op](have, release(clause[len(op):].strip())):
            return False
    return True


def check_keras():
    """Warn once per process when the installed Keras is outside the tested range; kmgpu
    runs on it either way. Imports Keras (the caller has chosen a backend already)."""
    global _warned
    import keras

    version = keras.__version__
    with _LOCK:
        if _warned or in_range(version):
            return
        _warned = True
    warnings.warn(
        f"kmgpu: Keras {version} is outside the Keras releases kmgpu is tested with "
        f"({keras_fixes.KERAS}); running on it anyway. If something fails, try a Keras in "
        "that range.", UserWarning)  # attributed to kmgpu.versions: one filter silences it

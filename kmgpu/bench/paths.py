"""Where results live: the repository's ``benchmarks/results`` in a source checkout (the
committed runs), else ``./kmgpu-bench`` in the current directory (an installed wheel)."""

import os

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKOUT_RESULTS = os.path.join(PACKAGE_PARENT, "benchmarks", "results")
WHEEL_OUT = "kmgpu-bench"


def checkout():
    """True when this kmgpu is a source checkout's (its benchmarks/ folder is beside it)."""
    return (os.path.isfile(os.path.join(PACKAGE_PARENT, "benchmarks", "RESULTS.md"))
            and os.path.isfile(os.path.join(PACKAGE_PARENT, "pyproject.toml")))


def results_folder():
    """The committed results of a checkout, or None when kmgpu runs from a wheel."""
    return CHECKOUT_RESULTS if checkout() else None


def default_out():
    """The default --out: the checkout's results folder, else ./kmgpu-bench."""
    return CHECKOUT_RESULTS if checkout() else os.path.join(os.getcwd(), WHEEL_OUT)

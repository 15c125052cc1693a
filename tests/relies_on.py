"""``relies_on``: names the Keras-patch rows a behaviour test checks.

Each ``PATCHES`` row of ``kmgpu/engines/**/keras_fixes.py`` names a Keras internal and
what Keras does there; the behaviour tests (``tests/unit/test_keras_behaviour.py`` for the
shared rows, ``tests/<backend>/test_keras_behaviour.py`` for each backend's) check that
Keras still does it, so a Keras release that changes it fails a named test instead of a
version guard. ``tests/unit/test_patches.py`` reads the decorators from the source (no
backend imported) and checks that every row is covered.
"""


def relies_on(*rows):
    """Mark a test as checking the Keras behaviour of ``rows``: each a literal
    ``(module, attribute)`` pair, as in a PATCHES row."""
    def mark(test):
        test.relies_on = rows
        return test
    return mark

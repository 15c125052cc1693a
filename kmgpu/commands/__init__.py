"""The ``kmgpu`` command line: ``cli`` dispatches to ``demo``, ``bench`` and ``launch``."""

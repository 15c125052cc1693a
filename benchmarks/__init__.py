"""``kmgpu bench``: throughput, scaling and parity per backend, against the plain and
framework-native ways of doing the same (see README.md here and ``kmgpu bench --help``).

Modules: ``workloads`` (models and data), ``runners`` (kmgpu, plain ``fit`` and the
peers, measured the same way), ``worker`` (one backend's runs in one process),
``main`` (plans the runs, starts the workers, progress bar, parity and ratios),
``report`` (JSON -> markdown table and PNG plot).
"""

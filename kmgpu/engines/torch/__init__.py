"""The torch engine: DDP inside Keras's ``fit``. At the top: ``engine``, ``strategy`` (one
rank), ``replicas``, ``runtime``, ``precision``, ``collectives`` (tensors over the ranks),
``transport`` (files and pickling between the driver and the ranks) and the Keras-patch
registry (``keras_fixes`` and its ``*_fixes`` role modules); by role: launch, steps,
capture, optim, fast, data."""

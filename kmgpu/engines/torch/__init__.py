"""The torch engine: DDP inside Keras's ``fit`` (engine, strategy, launchers, worker, runtime, keras_fixes)."""

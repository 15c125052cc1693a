"""The JAX engine: ``keras.distribution`` / ``jax.sharding`` (engine, runtime, keras_fixes)."""

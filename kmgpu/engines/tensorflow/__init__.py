"""The TensorFlow engine: ``tf.distribute`` (engine, runtime, keras_fixes)."""

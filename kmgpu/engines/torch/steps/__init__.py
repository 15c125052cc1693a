"""What one rank runs per step: Keras's step through DDP, the split step, a model's own step,
and the global batch a step reaches."""

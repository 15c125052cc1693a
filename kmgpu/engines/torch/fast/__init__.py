"""Faster kernels for Keras layers on CUDA (fused BatchNorm, Dense, convolutions, masked RNNs),
swapped in by ``fast_fixes``."""

"""Keras's optimizers over flat buffers, and ZeRO-1 (``shard_optimizer``) on a piece of them."""

"""The user's data on the ranks: accepted, sent and cut per rank (``inputs``), datasets read for
the ranks (``feeds``), Keras's shuffled order, and arrays kept on the GPU."""

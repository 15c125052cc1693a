"""How the rank processes come to exist (a worker pool, or torchrun's processes) and how calls,
state, outputs and callback events travel between them and the driver."""

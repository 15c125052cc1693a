"""CUDA-graph capture of the train, test and predict steps, and the random numbers a captured
step draws."""

"""Shared test set-up. The backend is fixed per process (KERAS_BACKEND); the runner
``scripts/test.sh`` runs tests/common plus tests/<backend> once per backend.

Four simulated devices stand in for GPUs; they must exist before Keras touches
its backend, so this runs before anything imports keras.
"""

import os

import kmgpu

kmgpu.simulate_devices(int(os.environ.get("KMGPU_TEST_DEVICES", "4")))

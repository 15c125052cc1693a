"""What a kmgpu process imports: ``import kmgpu`` no backend at all, and a fit, evaluate
and predict on 2 devices nothing plain Keras would not (on JAX and torch, plain Keras
never imports TensorFlow: Keras's serializer would, to test for its types; on
TensorFlow there is nothing the fit could add, so that process stops after the import).
In a fresh process: the test session itself has imported everything."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import kmgpu
after_import = sorted(m for m in ("tensorflow", "jax", "torch") if m in sys.modules)
if sys.argv[1] == "tensorflow":
    print(json.dumps({"after_import": after_import}))
    sys.exit()
kmgpu.simulate_devices(2)
import keras
import numpy as np
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
parallel = kmgpu.parallelize(model)
parallel.compile(optimizer="adam", loss="mse", metrics=["mae"])
x = np.linspace(0, 1, 40, dtype="float32").reshape(8, 5)
parallel.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
parallel.evaluate(x, x[:, :1], verbose=0)
rows = len(parallel.predict(x, verbose=0))
print(json.dumps({"after_import": after_import, "rows": rows,
                  "tensorflow": "tensorflow" in sys.modules}))
"""


def test_kmgpu_imports_no_backend_and_no_tensorflow_beside_jax_or_torch():
    backend = os.environ["KERAS_BACKEND"]
    done = subprocess.run([sys.executable, "-c", SCRIPT, backend], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["after_import"] == []
    if backend != "tensorflow":
        assert found["rows"] == 8
        assert not found["tensorflow"]

"""TensorFlow engine: what one more fit() call costs. kmgpu's fit on arrays with and
without the repeating tf.data pipeline for a one-epoch fit (Keras otherwise makes two
distributed iterators per fit: the second, for a next epoch, is never used), 4 simulated
devices, one step per fit, order-balanced (ABBA) in one process. Prints one line.

    KERAS_BACKEND=tensorflow PYTHONPATH=$PWD python benchmarks/tf_fit_per_call.py 1024
"""
import sys, time, warnings
import kmgpu
kmgpu.simulate_devices(4)
import keras, numpy as np
warnings.simplefilter("ignore")
from kmgpu.engines.tensorflow import data_fixes as kf
new = kf.repeating_datasets
def old(kwargs, kept=None):
    if kwargs.get("epochs", 1) - kwargs.get("initial_epoch", 0) < 2: return kwargs
    return new(kwargs, kept)
W = int(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.normal(size=(256, W)).astype("float32"); y = rng.normal(size=(256, 1)).astype("float32")
keras.utils.set_random_seed(1)
m = keras.Sequential([keras.Input((W,)), keras.layers.Dense(W, activation="relu"), keras.layers.Dense(W, activation="relu"), keras.layers.Dense(1)])
p = kmgpu.parallelize(m, gpus=4); p.compile(optimizer="adam", loss="mse")
p.fit(x, y, batch_size=256, epochs=1, verbose=0); p.fit(x, y, batch_size=256, epochs=2, verbose=0)
res = {"old": [], "new": []}
for rnd in range(4):
    for name, fn in (("old", old), ("new", new)) if rnd % 2 == 0 else (("new", new), ("old", old)):
        kf.repeating_datasets = fn
        t0 = time.perf_counter()
        for _ in range(5): p.fit(x, y, batch_size=256, epochs=1, verbose=0)
        res[name].append((time.perf_counter() - t0) / 5)
t0 = time.perf_counter(); p.fit(x, y, batch_size=256, epochs=10, verbose=0); ten = time.perf_counter() - t0
print(f"params {m.count_params()}: per fit(epochs=1): old {np.median(res['old']):.3f}s new {np.median(res['new']):.3f}s (medians of 4 rounds of 5, ABBA); fit(epochs=10) {ten:.3f}s; 10 x fit(1)/fit(10): old {10*np.median(res['old'])/ten:.2f} new {10*np.median(res['new'])/ten:.2f}")

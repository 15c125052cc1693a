"""The reference scenario shared by the demo, notebooks, benchmarks and tests.

Series 60*sin(0.1 i), i = 0..159; MinMax-scaled to [0, 1]; the first 67% trains;
look_back 1 (X = value at t, Y = value at t+1); LSTM(4) + Dense(1); adam, mse,
100 epochs, batch 8; RMSE reported in the series' own units.
"""

import numpy as np

EPOCHS = 100
BATCH = 8


def data():
    """((x_train, y_train), (x_test, y_test), scale) with x of shape (n, 1, 1)."""
    series = 60 * np.sin(0.1 * np.arange(160, dtype="float64"))
    lo, hi = float(series.min()), float(series.max())
    scaled = ((series - lo) / (hi - lo)).astype("float32")
    cut = int(len(scaled) * 0.67)

    def windows(s):
        return s[:-1].reshape(-1, 1, 1), s[1:].reshape(-1, 1)

    return windows(scaled[:cut]), windows(scaled[cut:]), (lo, hi)


def model(seed=7):
    """LSTM(4) + Dense(1) on (1, 1) inputs, with fixed initial weights for a seed."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((1, 1)), keras.layers.LSTM(4), keras.layers.Dense(1)])


def rmse(model, x, y, scale, predict=None):
    """Root mean squared error in the series' own units."""
    lo, hi = scale
    pred = (predict or model.predict)(x, verbose=0)
    return float(np.sqrt(np.mean(((pred - y) * (hi - lo)) ** 2)))

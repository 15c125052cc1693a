"""The reference scenario: the sine-wave LSTM on 4 devices predicts like one device."""

import numpy as np

import kmgpu
from kmgpu import sine


def test_sine_on_four_devices_matches_one_device_and_saves(tmp_path):
    import keras

    (x_tr, y_tr), (x_te, y_te), scale = sine.data()
    one = sine.model()
    one.compile(optimizer="adam", loss="mse")
    one.fit(x_tr, y_tr, batch_size=sine.BATCH, epochs=sine.EPOCHS, shuffle=False, verbose=0)
    rmse_one = sine.rmse(one, x_te, y_te, scale)

    model = sine.model()
    parallel = kmgpu.parallelize(model, gpus=4)
    parallel.compile(optimizer="adam", loss="mse")
    parallel.fit(x_tr, y_tr, batch_size=sine.BATCH, epochs=sine.EPOCHS, shuffle=False, verbose=0)
    rmse_four = sine.rmse(model, x_te, y_te, scale)  # the user's own model, not a clone
    print(f"sine test RMSE: 1 device {rmse_one:.3f}, 4 devices {rmse_four:.3f}")
    assert rmse_one < 8.0, "the one-device baseline itself did not learn"
    assert abs(rmse_four - rmse_one) <= 0.10 * rmse_one

    path = tmp_path / "sine.keras"
    parallel.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x_te, verbose=0), model.predict(x_te, verbose=0),
                               rtol=1e-6, atol=1e-7)

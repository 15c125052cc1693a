"""One device, and nothing kmgpu must add: the user's own ``model.fit``.

With a single replica, re-creating the model on the device and copying state in
and out buys nothing, and every backend's one-device path (a one-device
DataParallel, a DDP worker process) costs time and memory against plain Keras.
A backend engine says when this is exact (``Engine.plain_fit_serves``); then
``fit`` / ``evaluate`` / ``predict`` are the model's own, so the trained weights
are in the user's model by construction, as with plain Keras.
"""

from kmgpu.engines.base import Engine


class LocalEngine(Engine):
    name = "keras.Model.fit on one device (your model itself, no replica)"
    supports_stateful = True  # only chosen where plain Keras carries the state itself

    def run(self, method, template, kwargs, lr_scale=(1.0, 0)):
        return getattr(template, method)(**kwargs)

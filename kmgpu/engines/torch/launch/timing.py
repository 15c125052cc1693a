"""``KMGPU_TORCH_TIMING=1``: print where a torch call's time went.

One ``Clock`` for both sides: the driver ("kmgpu parent timing: pool 0.001s, ...")
and rank 0 of the pool ("kmgpu worker timing: replica 0.002s, ...").
"""

import time

from kmgpu import environment


class Clock:
    """Time spent per named part of a call; prints them when ``KMGPU_TORCH_TIMING`` is set.

    Args:
        side: "parent" or "worker", for the printed line.
        on: also required to print (e.g. only rank 0 of the workers).
    """

    def __init__(self, side, on=True):
        self.side = side
        self.on = bool(on) and bool(environment.setting("KMGPU_TORCH_TIMING"))
        self.t, self.parts, self.counts = time.perf_counter(), {}, {}

    def __call__(self, name, since=None):
        """Add the time since the last mark (or since ``since``, leaving the mark) to ``name``."""
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - (since or self.t)
        self.counts[name] = self.counts.get(name, 0) + 1
        if since is None:
            self.t = now

    def report(self):
        if self.on:
            print(f"kmgpu {self.side} timing: "
                  + ", ".join(f"{k} {v:.3f}s" + (f" ({self.counts[k]}x)" if self.counts[k] > 1
                                                 else "")
                            for k, v in self.parts.items()), flush=True)

"""Ctrl-C while a torch worker pool runs a call: the first press asks the workers to stop
after the current step (the pool lives on and hands back that step's state); a second
press, or a call that does not answer within ``Interrupts.GRACE`` seconds, raises."""

import signal
import sys
import time


class Interrupts:
    """Ctrl-C while a call runs: the first one calls ``on_interrupt`` (and is noted in
    ``pressed``) instead of raising; a second one, or ``GRACE`` seconds without an
    answer, raises KeyboardInterrupt (from ``check``). Without ``on_interrupt``, or off
    the main thread, Ctrl-C raises at once as usual.
    """

    GRACE = 60.0

    def __init__(self, on_interrupt):
        self.on_interrupt, self.pressed, self.deadline = on_interrupt, False, None
        self._saved = None

    def __enter__(self):
        import threading

        if self.on_interrupt is not None and threading.current_thread() is \
                threading.main_thread():
            self._saved = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            signal.signal(signal.SIGINT, self._saved)
            self._saved = None

    def _handle(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed, self.deadline = True, time.monotonic() + self.GRACE
        print("\nkmgpu: Ctrl-C: the workers stop after the current step and hand back its "
              "weights (Ctrl-C again stops them now).", file=sys.stderr, flush=True)
        self.on_interrupt()

    def check(self):
        """Raise KeyboardInterrupt once the workers had their time to stop."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise KeyboardInterrupt

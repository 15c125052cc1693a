"""Shared test set-up. The backend is fixed per process (KERAS_BACKEND); the runner
``scripts/test.sh`` runs tests/common plus tests/<backend> once per backend.

Four simulated devices stand in for GPUs; they must exist before Keras touches
its backend, so this runs before anything imports keras.

``--file-progress`` (scripts/test.sh passes it) prints one line per finished test file,
with its results and times, instead of a dot per test, and one line for any test that
takes long: a session of several minutes shows that it moves.
"""

import collections
import os
import time

import pytest

import kmgpu
from kmgpu.hardware import backend_name

#: The suite checks kmgpu's code paths and their parity with one device, both sides
#: compiled alike; how well a compiler optimises tiny models is not what it tests, yet
#: compiling them is most of a JAX or TensorFlow session. So XLA skips LLVM's expensive
#: passes (the arithmetic stays bit for bit) and TensorFlow's graph optimiser (Grappler)
#: is off (without its fused kernels float32 results move in the last digit, on one
#: device and on N alike). XLA's optimisation level 0, which ``kmgpu bench --quick``
#: uses, would save more but rounds differently enough (no fused multiply-adds) to move
#: an Adam parity figure from 3.7e-6 to 1.7e-5. KMGPU_TEST_COMPILE=full keeps both
#: compilers' defaults; the suite passes either way.
FAST_COMPILE = os.environ.get("KMGPU_TEST_COMPILE", "fast") != "full"
if FAST_COMPILE:
    os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + [
        "--xla_llvm_disable_expensive_passes=true"])

kmgpu.simulate_devices(int(os.environ.get("KMGPU_TEST_DEVICES", "4")))

if FAST_COMPILE and backend_name() == "tensorflow":
    import tensorflow as tf

    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

SLOW_TEST_S = 45.0  # a test this long gets a line of its own


def pytest_addoption(parser):
    parser.addoption("--file-progress", action="store_true",
                     help="one line per finished test file (results, seconds) instead of "
                          f"a dot per test, and one per test over {SLOW_TEST_S:.0f} s")


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the suite once per backend, and what is the same in every
    backend's session once per suite: the quick bench smoke in the sessions that
    KMGPU_BENCH_SMOKE names (empty: none), the ``backend_neutral`` tests in the sessions
    of the backend KMGPU_NEUTRAL_IN names. Unset, a session runs them all. What a
    session leaves to another it deselects, so no session reports it skipped."""
    gone = []
    if os.environ.get("KMGPU_BENCH_SMOKE") == "":
        gone += [item for item in items if item.name == "test_quick_bench_smoke"]
    neutral_in = os.environ.get("KMGPU_NEUTRAL_IN")
    if neutral_in and neutral_in != backend_name():
        gone += [item for item in items if item.get_closest_marker("backend_neutral")]
    if gone:
        items[:] = [item for item in items if item not in gone]
        config.hook.pytest_deselected(items=gone)


@pytest.hookimpl(trylast=True)  # after the terminal reporter is there
def pytest_configure(config):
    if config.getoption("--file-progress") and config.pluginmanager.has_plugin(
            "terminalreporter"):
        config.pluginmanager.register(FileProgress(config), "kmgpu-file-progress")


class FileProgress:
    def __init__(self, config):
        self.terminal = config.pluginmanager.get_plugin("terminalreporter")
        self.started = time.monotonic()
        self.left = collections.Counter()  # tests not yet finished, per file
        self.counts = collections.defaultdict(collections.Counter)  # file -> outcome -> n
        self.file_started = {}
        self.outcome = {}  # nodeid -> its outcome so far
        self.files = self.done = 0

    def _line(self, text):
        self.terminal.write_line(text)

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.left[item.nodeid.split("::")[0]] += 1
        self.files = len(self.left)
        files = f"{self.files} file" + "s" * (self.files != 1)
        self._line(f"{len(session.items)} tests in {files} (collected in "
                   f"{time.monotonic() - self.started:.0f} s)")

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(self, report, config):
        status = yield
        if status and isinstance(status, tuple) and len(status) == 3:
            return status[0], "", status[2]  # no dot or letter: the file's line counts them
        return status

    def pytest_runtest_logstart(self, nodeid, location):
        self.file_started.setdefault(nodeid.split("::")[0], time.monotonic())
        self._test_started = time.monotonic()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call":
            outcome = "xpassed" if hasattr(report, "wasxfail") else "passed"
        else:
            return
        if self.outcome.get(report.nodeid) not in ("failed", "error"):
            self.outcome[report.nodeid] = outcome

    def pytest_runtest_logfinish(self, nodeid, location):
        path = nodeid.split("::")[0]
        self.counts[path][self.outcome.pop(nodeid, "passed")] += 1
        now = time.monotonic()
        if now - self._test_started >= SLOW_TEST_S:
            self._line(f"  {nodeid}: {now - self._test_started:.0f} s")
        self.left[path] -= 1
        if self.left[path] == 0:
            self.done += 1
            counts = ", ".join(f"{n} {k}" for k, n in sorted(
                self.counts[path].items(), key=lambda kv: kv[0] != "passed"))
            self._line(f"{path}: {counts} in {now - self.file_started[path]:.0f} s "
                       f"({self.done}/{self.files} files, {now - self.started:.0f} s in all)")


def pytest_unconfigure(config):
    """TensorFlow sessions: the objects the session made (about 770,000 in a third of the
    TF files: Keras models, traced graphs) are frozen, out of Python's last garbage
    collections at exit, which walked them all: 4.6 s of a part's exit on an idle machine
    (0.3 s frozen), and longer beside a busy lane. Nothing the tests check runs in what
    those collections would free. Not for JAX / torch, whose worker pools may end through
    their finalizers."""
    if os.environ.get("KERAS_BACKEND") == "tensorflow":
        import gc

        gc.freeze()

"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, without error.

Each notebook chooses its backend in its first cell; its metadata ("kmgpu": {"backend"})
says which backend's test session executes it, so each runs once per suite. The kernel
starts from a clean environment: none of this session's KERAS_BACKEND, simulated
devices or XLA flags leak into it.
"""

import glob
import json
import os
import re
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
LEAKY = ("KERAS_BACKEND", "KMGPU_SIMULATE_DEVICES", "KMGPU_TEST_DEVICES", "XLA_FLAGS",
         "JAX_PLATFORMS", "KMGPU_SINE_EPOCHS", "KMGPU_RUN_BENCH", "MPLBACKEND")


def _backend_of(path):
    with open(path) as f:
        return json.load(f).get("metadata", {}).get("kmgpu", {}).get("backend")


def _session_backend():
    import keras

    return keras.config.backend()


def _text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
            parts.append(out["data"].get("text/markdown", ""))
    return "".join(parts)


def execute(path, timeout=240):
    """Run a notebook in a fresh python3 kernel; return (notebook, seconds)."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError on any error
    return notebook, time.perf_counter() - start


def test_notebooks_are_stored_without_outputs():
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        with open(path) as f:
            nb = json.load(f)
        assert _backend_of(path) in ("tensorflow", "jax", "torch"), path
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, \
                    f"{os.path.basename(path)} is stored with outputs: clear them"
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        source = "".join(first["source"])
        assert "KERAS_BACKEND" in source and (
            "import keras" not in source
            or source.index("KERAS_BACKEND") < source.index("import keras")), path


def _this_session(paths):
    from kmgpu import hardware

    return [p for p in paths if _backend_of(p) == hardware.backend_name()]


def test_every_notebook_belongs_to_one_backend_session():
    sessions = {_backend_of(p) for p in NOTEBOOKS}
    assert NOTEBOOKS and sessions <= {"tensorflow", "jax", "torch"}, sessions


@pytest.mark.parametrize("path", _this_session(NOTEBOOKS),
                         ids=[os.path.basename(p) for p in _this_session(NOTEBOOKS)])
def test_notebook_runs(path):
    assert _backend_of(path) == _session_backend()
    notebook, seconds = execute(path)
    sys.stderr.write(f"\n{os.path.basename(path)}: {seconds:.1f} s\n")
    outputs = "\n".join(_text(c) for c in notebook.cells if c.cell_type == "code")
    name = os.path.basename(path)
    if "quickstart" in name:
        # torch through multi-process DDP: rank 0's epoch progress reaches the cell
        assert re.search(r"Epoch 1/5", outputs), outputs[-2000:]
        assert re.search(r"Epoch 5/5", outputs)
        assert re.search(r"\d+/\d+ - .*loss: [0-9.]+", outputs), outputs[-2000:]
        assert "torch DistributedDataParallel" in outputs
        assert "reloaded predicts the same: True" in outputs
    if "sine_traps" in name:
        assert "RMSE table" in outputs
        for run in ("1 device (plain fit)", "naive batch x", "kmgpu, global batch",
                    "kmgpu, per-replica + LR scaling"):
            assert run in outputs, run
        assert re.search(r"\| train RMSE \| test RMSE", outputs)
        assert any("image/png" in o.get("data", {}) for c in notebook.cells
                   for o in c.get("outputs", [])), "no plot"
    if "stateful" in name:
        ratio = re.search(r"state makes the error (\d+)x smaller", outputs)
        assert ratio and int(ratio.group(1)) >= 5, outputs[-2000:]
        assert "| stateful=True" in outputs and "replica r keeps rows" in outputs
        assert "step by step equals batched: True" in outputs
    if "comparison" in name:
        assert "kmgpu against plain fit and the peer" in outputs
        assert any("image/png" in o.get("data", {}) for c in notebook.cells
                   for o in c.get("outputs", [])), "no plot"

"""Every notebook in notebooks/ is committed executed, with its outputs (a reader on a code
host sees the tables, plots and timings), and runs top to bottom in a fresh kernel,
without error, in its backend's test session.

Each notebook chooses its backend in its first cell; its metadata ("kmgpu": {"backend"})
says which backend's test session executes it, so each runs once per suite. The kernel
starts from a clean environment: none of this session's KERAS_BACKEND, simulated
devices or XLA flags leak into it; without a GPU the notebook simulates its devices.
The committed outputs come from the same run (``bash scripts/notebooks.sh``: CPU,
simulated devices) and hold no path of the machine that made them.

The test session runs 02_sine_traps shortened, as its first cell offers: KMGPU_SINE_EPOCHS
(the notebook reads it and prints that the run is short) sets 6 epochs instead of the
scenario's 100, past the 5-epoch warm-up, so every cell and every run of it still
executes; the committed outputs are the full scenario's.
"""

import getpass
import glob
import json
import os
import re
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
LEAKY = ("KERAS_BACKEND", "KMGPU_SIMULATE_DEVICES", "KMGPU_TEST_DEVICES", "XLA_FLAGS",
         "JAX_PLATFORMS", "KMGPU_SINE_EPOCHS", "KMGPU_RUN_BENCH", "MPLBACKEND")
# where a machine's own paths start: checkouts, homes, temporary folders, installations
MACHINE_PATH = re.compile(r"(/work|/root|/tmp|/home|/Users|/private|/var|/opt|/usr|/mnt)/")


def _backend_of(path):
    with open(path) as f:
        return json.load(f).get("metadata", {}).get("kmgpu", {}).get("backend")


def _session_backend():
    import keras

    return keras.config.backend()


def _str(text):
    return "".join(text) if isinstance(text, list) else text  # a stored file: lists of lines


def _text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
            parts.append(out["data"].get("text/markdown", ""))
    return "".join(_str(p) for p in parts)


def _has_plot(notebook):
    return any("image/png" in o.get("data", {}) for c in notebook["cells"]
               for o in c.get("outputs", []))


def check_outputs(name, notebook):
    """What each notebook must show (asserted on a fresh run and on the committed file)."""
    outputs = "\n".join(_text(c) for c in notebook["cells"] if c["cell_type"] == "code")
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
        assert _has_plot(notebook), "no plot"
    if "stateful" in name:
        ratio = re.search(r"state makes the error (\d+)x smaller", outputs)
        assert ratio and int(ratio.group(1)) >= 5, outputs[-2000:]
        assert "| stateful=True" in outputs and "replica r keeps rows" in outputs
        assert "step by step equals batched: True" in outputs
    if "comparison" in name:
        assert "kmgpu against plain fit and the peer" in outputs
        assert _has_plot(notebook), "no plot"
        # stored GPU figures only with what they mean (and why some exceed 1)
        prose = "\n".join(_str(c["source"]) for c in notebook["cells"]
                          if c["cell_type"] == "markdown")
        for term in ("**efficiency**", "**kmgpu / plain fit**", "**plain vs plain again**",
                     "**parity**",
                     "**speedup**", "can exceed 1", "above 1 mean"):
            assert term in prose, term
    # describe() prints the plan once, not also as a quoted string or a repr
    assert "'kmgpu plan" not in outputs and "<kmgpu plan" not in outputs


def machine_paths(notebook):
    """Paths of the machine that ran the notebook, found in its outputs (text of every
    kind, tracebacks too; not the images)."""
    mine = {ROOT, sys.prefix, os.path.expanduser("~"), tempfile.gettempdir()}
    user = getpass.getuser()
    found = []
    for cell in notebook["cells"]:
        for out in cell.get("outputs", []):
            texts = [out.get("text", ""), out.get("evalue", "")] + list(out.get("traceback", []))
            texts += [v for k, v in out.get("data", {}).items() if k.startswith("text/")]
            for text in map(_str, texts):
                found += [m.group(0) + text[m.end():m.end() + 40]
                          for m in MACHINE_PATH.finditer(text)]
                found += [p for p in mine if len(p) > 1 and p in text]
                if len(user) > 2 and user != "root":
                    found += re.findall(rf"[/\\]{re.escape(user)}\b", text)
    return found


#: what the test session sets for a notebook, to run it shorter (its own settings)
SHORT = {"02_sine_traps.ipynb": {"KMGPU_SINE_EPOCHS": "6"}}


def execute(path, timeout=240, **settings):
    """Run a notebook in a fresh python3 kernel, with environment ``settings`` added;
    return (notebook, seconds)."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env.update(settings)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     record_timing=False, coalesce_streams=True,
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError on any error
    return notebook, time.perf_counter() - start


def test_notebooks_are_committed_executed():
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        name = os.path.basename(path)
        with open(path) as f:
            nb = json.load(f)
        assert _backend_of(path) in ("tensorflow", "jax", "torch"), path
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert [c.get("execution_count") for c in code] == list(range(1, len(code) + 1)), \
            f"{name} is not stored executed top to bottom: bash scripts/notebooks.sh"
        assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"], name
        check_outputs(name, nb)
        first = code[0]
        source = "".join(first["source"])
        assert "KERAS_BACKEND" in source and (
            "import keras" not in source
            or source.index("KERAS_BACKEND") < source.index("import keras")), path


def test_committed_outputs_hold_no_machine_paths():
    for path in NOTEBOOKS:
        with open(path) as f:
            found = machine_paths(json.load(f))
        assert not found, f"{os.path.basename(path)}: {found[:5]}"
    # the search finds what it looks for
    leaky = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stderr", "text": ["/home/ann/kmgpu/api.py:42: w"]},
        {"output_type": "error", "ename": "E", "evalue": "", "traceback": [ROOT + "/x.py"]},
        {"output_type": "display_data", "data": {"text/plain": "saved /tmp/tmpab12/m.keras"}}]}]}
    assert len(machine_paths(leaky)) >= 3


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
    name = os.path.basename(path)
    notebook, seconds = execute(path, **SHORT.get(name, {}))
    sys.stderr.write(f"\n{name}: {seconds:.1f} s\n")
    check_outputs(name, notebook)
    if "KMGPU_SINE_EPOCHS" in SHORT.get(name, {}):  # the notebook read it
        outputs = "\n".join(_text(c) for c in notebook["cells"] if c["cell_type"] == "code")
        epochs = SHORT[name]["KMGPU_SINE_EPOCHS"]
        assert f"NOTE: KMGPU_SINE_EPOCHS={epochs} - a shortened run" in outputs, outputs[:2000]
        assert f"; {epochs} epochs" in outputs
    assert not machine_paths(notebook), machine_paths(notebook)[:5]


def main(paths):
    """Execute the notebooks (default: all) as the tests do and save them with outputs."""
    import nbformat

    for path in paths or NOTEBOOKS:
        notebook, seconds = execute(os.path.abspath(path))
        check_outputs(os.path.basename(path), notebook)
        found = machine_paths(notebook)
        nbformat.write(notebook, path)
        print(f"{os.path.relpath(path, ROOT)}: executed in {seconds:.0f} s"
              + (f"; machine paths in its outputs: {found[:3]}" if found else ""), flush=True)
        if found:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The documentation site builds: ``mkdocs build --strict`` (a broken link, a page
missing from the nav or an API name mkdocstrings cannot find fails it). Once per suite:
in the JAX session."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()

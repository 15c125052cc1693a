"""Every code block of README.md and docs/*.md runs, with Sybil.

Python blocks run in order, one namespace per page, on the simulated CPU devices of the
session (tests/conftest.py), in a temporary working directory. Each page runs in the
sessions of the backends PAGES names (its blocks are tiny, yet every new model costs a
compile: running each page once keeps the docs under ~30 s per backend); a block meant
for one backend says so with Sybil's skip directive, e.g.
``<!-- skip: next if(BACKEND != "torch", reason="torch only") -->``, and a block that
needs GPUs or several processes with ``<!-- skip: next "why" -->``.

Shell blocks (```bash) are not run (they install, train for minutes or start hosts);
each line is checked instead: ``kmgpu demo|bench|launch`` options parse with the
command's own parser, ``bash scripts/X.sh`` and ``python benchmarks/X.py`` exist, and
``pip install "kmgpu[extra]"`` names an extra of pyproject.toml.
"""

import os
import pathlib
import shlex
import unittest
import warnings

import pytest
from sybil import Sybil
from sybil.parsers.markdown import (ClearNamespaceParser, CodeBlockParser,
                                    PythonCodeBlockParser, SkipParser)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")

#: page -> the backends whose session runs its Python blocks (shell blocks: the first)
PAGES = {
    "README.md": ("jax",),
    "docs/index.md": ("torch",),
    "docs/batch-size.md": ("tensorflow",),
    "docs/one-device.md": ("torch",),
    "docs/batchnorm.md": ("tensorflow",),
    "docs/stateful.md": ("jax",),
    "docs/precision.md": ("torch",),
    "docs/sharding.md": ("jax", "torch"),
    "docs/notebooks.md": ("jax",),
    "docs/several-hosts.md": ("torch",),
    "docs/migrating.md": ("jax",),
    "docs/gradient-accumulation.md": ("jax", "torch"),
    "docs/keras-hub.md": ("torch",),
    "docs/faults.md": ("jax",),
    "docs/backends.md": ("torch",),
    "docs/benchmarks.md": ("jax",),
    "docs/troubleshooting.md": ("jax",),
    "docs/settings.md": ("torch",),
    "docs/design.md": ("jax",),
    "docs/sharding-design.md": ("jax",),
    "docs/api.md": ("jax",),
    "docs/command.md": ("jax",),
}


def _shell_line(line):
    """Check one shell command of a ```bash block; an AssertionError says what is wrong."""
    words = shlex.split(line, comments=True)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value before the command
    if words[:1] == ["srun"]:
        words = words[1:]
    if not words:
        return
    if words[0] == "kmgpu" and len(words) > 1:
        from kmgpu.commands import demo, launch

        parsers = {"demo": demo.parse, "launch": launch._parser().parse_args}
        if words[1] == "bench":
            from kmgpu.bench import cli

            parsers["bench"] = cli.parse
        if words[1] not in parsers:
            assert words[1] in ("--help", "-h"), f"no kmgpu command {words[1]!r}: {line}"
            return
        if "--help" in words or "-h" in words:
            return
        try:
            parsers[words[1]](words[2:])
        except SystemExit as e:
            raise AssertionError(f"`{line}` does not parse (exit {e.code})") from None
    elif words[0] in ("bash", "python", "python3") and len(words) > 1 and words[1] != "-m":
        assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist: {line}"
    elif words[:2] == ["pip", "install"]:
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        for word in words[2:]:
            if word.startswith("kmgpu[") or word.startswith(".["):
                for extra in word.split("[", 1)[1].rstrip("]").split(","):
                    assert extra in extras, f"no extra {extra!r} in pyproject.toml: {line}"


def _check_shell(example):
    for line in example.parsed.splitlines():
        _shell_line(line.strip())


def _setup(namespace):
    namespace["BACKEND"] = BACKEND


SYBIL = Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", _check_shell),
                       SkipParser(), ClearNamespaceParser()])


def _examples():
    params = []
    for page, backends in PAGES.items():
        path = ROOT / page
        if not path.exists():
            params.append(pytest.param(None, None, id=f"{page} (missing)"))
            continue
        if BACKEND not in backends:
            continue
        document = SYBIL.parse(path)
        _setup(document.namespace)
        examples = [e for e in document
                    if e.region.evaluator is not _check_shell or BACKEND == backends[0]]
        if examples:
            LAST.add(id(examples[-1]))
        params += [pytest.param(page, e, id=f"{page}:{e.line}") for e in examples]
    return params


LAST = set()  # the last example of each page: its ParallelModels are closed after it


def _close_page(namespace):
    """Release the page's devices and torch workers, so later tests of the session
    find no worker pool of the docs alive."""
    import gc

    import kmgpu

    for value in list(namespace.values()):
        if isinstance(value, kmgpu.ParallelModel):
            value.close()
    namespace.clear()
    gc.collect()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Blocks that save files save them in a temporary folder; a page that sets Keras's
    global dtype policy leaves float32 behind for the rest of the session."""
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("docs"))
    yield
    os.chdir(here)
    import keras

    keras.mixed_precision.set_global_policy("float32")


def test_every_page_is_listed():
    pages = {"README.md"} | {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(PAGES), f"pages not in PAGES / gone: {pages ^ set(PAGES)}"


@pytest.mark.parametrize("page,example", _examples())
def test_code_block(page, example, workdir):
    assert example is not None, f"{page} is missing"
    with warnings.catch_warnings():
        # a page may show one of kmgpu's warnings (the suite makes them errors elsewhere)
        warnings.filterwarnings("default", message="kmgpu:", category=UserWarning)
        try:
            example.evaluate()
        except unittest.SkipTest as e:
            pytest.skip(str(e))
        finally:
            if id(example) in LAST:
                _close_page(example.namespace)

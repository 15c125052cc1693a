"""The package's shape: no import cycle, no module over 500 lines, the Keras range the
patch registries were checked against and pyproject.toml declares (the registries
themselves: tests/unit/test_patches.py), and ``import kmgpu`` imports no backend.
"""

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kmgpu"


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(source, name, package, modules):
    """The kmgpu modules ``source`` (module ``name`` in ``package``) imports, at module
    level or inside functions."""
    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # "from a import b" imports a.b when b is a module, else a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def import_graph():
    """module -> the kmgpu modules it imports, at module level or inside functions."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports(path.read_text(), name, package, modules)
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.backend_neutral
def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.backend_neutral
def test_no_import_cycle_anywhere_in_kmgpu():
    graph = import_graph()
    assert "kmgpu.engines.torch.engine" in graph  # the walk sees the backend folders
    assert "kmgpu.engines.replication" in graph["kmgpu.connector"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


#: modules outside kmgpu/engines that import nothing from kmgpu, so an engine may read them
LEAVES = {"kmgpu.environment"}


def _is_engine(name):
    return name == "kmgpu.engines" or name.startswith("kmgpu.engines.")


def engines_importing_the_front(graph):
    """"engine -> front module" for each import from kmgpu/engines of a module outside it
    (the package ``kmgpu`` itself and ``LEAVES`` allowed)."""
    return sorted(f"{name} -> {target}" for name, targets in graph.items() if _is_engine(name)
                  for target in targets
                  if not _is_engine(target) and target not in LEAVES and target != "kmgpu")


@pytest.mark.backend_neutral
def test_engines_import_only_engine_code_and_leaves():
    """The front imports ``kmgpu.engines``, never the other way: no module under
    kmgpu/engines imports a front module (api, connector, plan, checks, callbacks...),
    at module level or inside a function."""
    graph = import_graph()
    for leaf in LEAVES:
        assert not graph[leaf], f"{leaf} is a leaf: it may import nothing from kmgpu"
    wrong = engines_importing_the_front(graph)
    assert not wrong, "engines importing the front: " + ", ".join(wrong)


@pytest.mark.backend_neutral
def test_the_import_rule_sees_a_lazy_import_of_the_front():
    modules = _modules()
    lazy = ("import keras\nfrom kmgpu.engines import lr\n\n\ndef f():\n"
            "    from kmgpu import plan, environment\n    import kmgpu.callbacks\n"
            "    from ... import checks\n")
    name = "kmgpu.engines.torch.example"
    graph = {name: _imports(lazy, name, "kmgpu.engines.torch", modules)}
    assert engines_importing_the_front(graph) == [
        f"{name} -> kmgpu.callbacks", f"{name} -> kmgpu.checks", f"{name} -> kmgpu.plan"]
    assert "kmgpu.environment" in graph[name] and "kmgpu.engines.lr" in graph[name]


@pytest.mark.backend_neutral
def test_no_module_over_500_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"split these modules: {long}"


#: a reference to one of our issues ("issue 27", "#131") or a date in kmgpu/: a comment says
#: what the code does and why; when and in which issue belongs to git log and benchmarks/
ISSUE = re.compile(r"\bissues? ?#?\d+|(?<![\w&/\"'])#\d{3,}\b", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d\b")
#: an upstream project named just before: keras#19420, keras issue 19420, jax-ml/jax#123
UPSTREAM = re.compile(r"(keras|jax|tensorflow|torch|pytorch|xla|numpy|[\w.-]+/[\w.-]+) ?$",
                      re.IGNORECASE)
#: lines in files another change holds (kmgpu/engines/jax/engine.py's docstring): each one
#: exact, so a new reference there fails too; rewrite them, then empty this
KNOWN = set()


def history_references(text):
    """The issue numbers and dates ``text`` holds, upstream projects' issues left out."""
    found = [m.group() for m in DATE.finditer(text)]
    for m in ISSUE.finditer(text):
        if not UPSTREAM.search(text[max(0, m.start() - 40):m.start()]):
            found.append(m.group())
    return found


@pytest.mark.backend_neutral
def test_the_history_grep_tells_ours_from_upstream():
    assert history_references("fixed in issue 27 (#131), 2026-05-01") == [
        "2026-05", "issue 27", "#131"]
    assert history_references('keras#19420, keras #20585, jax-ml/jax#123, "#555555", '
                              "https://github.com/keras-team/keras/pull/20585") == []


@pytest.mark.backend_neutral
def test_no_issue_numbers_or_dates_in_the_code():
    root = PACKAGE.parent
    found = sorted((path.relative_to(root).as_posix(), ref)
                   for path in PACKAGE.rglob("*.py")
                   for ref in history_references(path.read_text()))
    wrong = [f"{path}: {ref}" for path, ref in found if (path, ref) not in KNOWN]
    assert not wrong, "say what and why instead: " + ", ".join(wrong)


#: a cited test file that another change holds (kmgpu/engines/jax/keras_fixes.py's docstring)
MISSING_CITED = set()


@pytest.mark.backend_neutral
def test_every_test_file_the_code_cites_exists():
    root = PACKAGE.parent
    cited = sorted((path.relative_to(root).as_posix(), ref) for path in PACKAGE.rglob("*.py")
                   for ref in re.findall(r"\btests/[\w/]+\.py\b", path.read_text()))
    assert cited
    missing = [f"{path}: {ref}" for path, ref in cited
               if not (root / ref).is_file() and (path, ref) not in MISSING_CITED]
    assert not missing, "cited but not there: " + ", ".join(missing)


def _fixes_modules():
    """The shared keras_fixes and this session's backend's (each backend's session reads
    its own: its internals import its backend)."""
    from kmgpu import hardware

    return ["kmgpu.engines.keras_fixes", f"kmgpu.engines.{hardware.backend_name()}.keras_fixes"]


def declared_keras():
    """The Keras range pyproject.toml's ``dependencies`` declare, e.g. ``">=3.14,<3.16"``."""
    import tomllib

    deps = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"][
        "dependencies"]
    found = [d for d in deps if re.match(r"keras\s*[<>=!]", d)]
    assert len(found) == 1, deps
    return found[0][len("keras"):].replace(" ", "")


@pytest.mark.parametrize("module", _fixes_modules())
def test_keras_fixes_were_checked_against_the_declared_range(module):
    """Each registry's ``KERAS`` is the range pyproject.toml declares (kmgpu.versions
    warns outside it); what each row relies on is checked by its behaviour test
    (tests/unit/test_keras_behaviour.py), not by a version guard."""
    fixes = importlib.import_module(module)
    assert fixes.KERAS == declared_keras(), (
        f"{module}: KERAS = {fixes.KERAS!r}, pyproject.toml declares {declared_keras()!r}")


def test_the_installed_keras_is_inside_the_declared_range():
    """The suite runs on a Keras the package declares (scripts/test_keras_master.sh
    deselects this test: it runs the Keras-internal set outside the range on purpose)."""
    import keras

    from kmgpu import versions

    assert versions.in_range(keras.__version__, declared_keras()), (
        f"Keras {keras.__version__} is outside pyproject.toml's {declared_keras()}: "
        "install one inside it, or test this one (scripts/test_oldest_keras.sh) and "
        "widen the range and KERAS in each kmgpu/engines/**/keras_fixes.py")


@pytest.mark.backend_neutral
def test_the_range_check_reads_versions_as_pip_does():
    from kmgpu import versions

    spec = ">=3.14,<3.16"
    assert versions.release("3.16.0.dev2026082101") == (3, 16, 0)
    assert versions.release("3.14") == (3, 14, 0)
    assert [versions.in_range(v, spec) for v in
            ("3.13.2", "3.14.0", "3.14.1", "3.15.1", "3.16.0", "3.16.0.dev1", "4.0")] == [
        False, True, True, True, False, False, False]
    assert versions.in_range("3.15.1", "==3.15.1") and not versions.in_range("3.15.1", "!=3.15.1")


@pytest.mark.backend_neutral
def test_import_kmgpu_imports_no_backend():
    code = ("import sys, kmgpu, kmgpu.hardware, kmgpu.environment, kmgpu.commands.cli; "
            "bad = [m for m in ('keras', 'tensorflow', 'jax', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=str(PACKAGE.parent))
    assert out.returncode == 0, out.stdout + out.stderr

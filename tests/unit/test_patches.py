"""The Keras-patch registry: one ``keras_fixes.py`` per backend package (and one for what
every backend shares) holds that package's ``PATCHES`` and ``READS`` tables; every
private Keras attribute kmgpu touches, anywhere in kmgpu, is a row of one of them; every
row names something the installed Keras still has; and ``swapped`` / ``install``, the
one way kmgpu changes Keras, put back what they change.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import pathlib
import re
import textwrap
import types

import pytest

from kmgpu.engines import keras_fixes

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kmgpu"
ENGINES = PACKAGE / "engines"
BACKENDS = ("tensorflow", "jax", "torch")
#: each registry's package (None: what every backend shares) -> its keras_fixes module
REGISTRIES = {None: "kmgpu.engines.keras_fixes",
              **{b: f"kmgpu.engines.{b}.keras_fixes" for b in BACKENDS}}
#: calls that name an attribute by a string: getattr(x, "_a"), install(x, "_a", ...),
#: swapped((x, "_a", make), ...)
NAMING_CALLS = {"getattr", "setattr", "hasattr", "delattr", "__setattr__", "install"}


def _backend_of(path):
    """The backend package a kmgpu file belongs to (None: shared or the front)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[1] if len(parts) > 2 and parts[0] == "engines" and parts[1] in BACKENDS \
        else None


def _is_registry(path):
    """A registry module: a ``keras_fixes.py`` or a role module beside it (``*_fixes.py``)."""
    return path.stem.endswith("_fixes") and path.parent in (
        ENGINES, *(ENGINES / b for b in BACKENDS))


def _tables(backend):
    """(PATCHES, READS) of one registry, read from its source (no backend imported)."""
    module = importlib.import_module(REGISTRIES[backend])
    return module.PATCHES, module.READS


def listed(backend):
    """The attribute names a kmgpu module of ``backend``'s package (None: shared or the
    front) may touch: the last part of each row's attribute, in its own registry and in
    the shared one."""
    rows = []
    for which in {None, backend}:
        patches, reads = _tables(which)
        rows += patches + reads
    return {row[1].rpartition(".")[2] for row in rows}


# -- which names are Keras's private attributes ------------------------------------------
def _defined_names(tree, module_level=True):
    """Private names ``tree`` defines: ``self._x = ...``, ``def _x``, class-level
    ``_x = ...`` (and with ``module_level``, module-level functions and classes)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                targets = (item.targets if isinstance(item, ast.Assign) else
                           [item.target] if isinstance(item, (ast.AnnAssign, ast.AugAssign))
                           else [])
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    names.add(t.attr)
        if isinstance(node, ast.Call):  # self.__dict__.update(_x=...), object.__setattr__
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "update" and isinstance(
                    func.value, ast.Attribute) and func.value.attr == "__dict__":
                names.update(k.arg for k in node.keywords if k.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@functools.lru_cache(maxsize=None)
def keras_private_names():
    """Private attribute names Keras's own source defines, less those kmgpu's classes
    define themselves (an access to one of those may be kmgpu's own)."""
    src = pathlib.Path(importlib.util.find_spec("keras").origin).parent / "src"
    keras_names = set()
    for path in src.rglob("*.py"):
        keras_names |= _defined_names(ast.parse(path.read_text(encoding="utf-8")))
    own = set()
    for path in PACKAGE.rglob("*.py"):
        own |= _defined_names(ast.parse(path.read_text()), module_level=False)
    return frozenset(keras_names - own)


def private_accesses(source, private):
    """(line, name) of each access of a name of ``private`` in ``source``: ``x._a``,
    ``getattr(x, "_a")`` and the other calls that name an attribute by a string, and the
    ``(owner, "_a", make)`` tuples of ``swapped``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called in NAMING_CALLS and len(node.args) > 1:
                names.append(node.args[1])
            if called == "swapped":
                names += [a.elts[1] for a in node.args
                          if isinstance(a, ast.Tuple) and len(a.elts) > 1]
        for name in names:
            name = name.value if isinstance(name, ast.Constant) else name
            if isinstance(name, str) and name in private:
                found.append((node.lineno, name))
    return sorted(found)


def unlisted(path, source):
    """"file:line name" for each private Keras attribute ``source`` (the file ``path``)
    touches that its registry does not list."""
    allowed = listed(_backend_of(path))
    rel = path.relative_to(PACKAGE.parent).as_posix()
    return [f"{rel}:{line} {name}" for line, name in
            private_accesses(source, keras_private_names()) if name not in allowed]


# -- (a) every private Keras attribute kmgpu touches is listed ---------------------------
@pytest.mark.backend_neutral
def test_every_private_keras_attribute_kmgpu_touches_is_listed():
    """Anywhere in kmgpu (the role modules beside each table included), an access of a
    private attribute Keras defines is a row of that package's PATCHES or READS, or of
    the shared registry's."""
    wrong = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in unlisted(path, path.read_text())]
    assert not wrong, ("private Keras attributes touched without a row in that backend's "
                       "keras_fixes.py (PATCHES, or READS when only read): " + ", ".join(wrong))


@pytest.mark.backend_neutral
def test_the_scan_sees_a_planted_private_access():
    private = keras_private_names()
    assert {"_flatten_layers", "_tracker", "_moments", "_loss_tracker"} <= private
    assert "_kmgpu_anything" not in private
    planted = ("def f(model, layer):\n"
               "    layer._tracker.unlock()\n"          # Layer._tracker: JAX's READS
               "    getattr(model, '_jit_compile')\n"   # listed nowhere
               "    with swapped((layer, '_build_shapes_dict', g)):\n"  # listed nowhere
               "        return model._flatten_layers()\n")  # shared READS
    torch_file = ENGINES / "torch" / "planted.py"
    assert private_accesses(planted, private) == [
        (2, "_tracker"), (3, "_jit_compile"), (4, "_build_shapes_dict"),
        (5, "_flatten_layers")]
    assert unlisted(torch_file, planted) == [
        "kmgpu/engines/torch/planted.py:2 _tracker",
        "kmgpu/engines/torch/planted.py:3 _jit_compile",
        "kmgpu/engines/torch/planted.py:4 _build_shapes_dict"]
    assert unlisted(ENGINES / "jax" / "planted.py", planted)[0].endswith(":3 _jit_compile")


# -- (b) every row names what the installed Keras has ------------------------------------
def _has(obj, name):
    """``obj.<name>`` exists, or ``obj`` is a class whose source (or a base class's) sets
    ``self.<name>``: an instance attribute."""
    if hasattr(obj, name):
        return True
    for cls in (obj.__mro__ if isinstance(obj, type) else ()):
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)", source):
            return True
    return False


def _resolve(where, attribute):
    obj = importlib.import_module(where)
    parts = attribute.split(".")
    for i, part in enumerate(parts):
        if not _has(obj, part):
            return None
        if i + 1 < len(parts):
            obj = getattr(obj, part)
    return obj


def _resolve_by(backend, by):
    """The kmgpu object a PATCHES row's ``by`` names: ``role_fixes.function`` in the
    row's package, or a whole ``kmgpu.`` path (module, then attributes)."""
    package = "kmgpu.engines" + (f".{backend}" if backend else "")
    parts = by.split(".") if by.startswith("kmgpu.") else [*package.split("."),
                                                           *by.split(".")]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    return None


def _session_registries():
    """The shared registry and this session's backend's (a row's module imports its
    backend)."""
    from kmgpu import hardware

    return [None, hardware.backend_name()]


@pytest.mark.parametrize("backend", _session_registries())
def test_every_row_names_what_the_installed_keras_has(backend):
    """Fails when a Keras upgrade removes or renames an internal kmgpu relies on."""
    patches, reads = _tables(backend)
    assert patches and reads
    for where, attribute, by, why in patches:
        assert why and by, (where, attribute)
        assert _resolve(where, attribute) is not None, \
            f"Keras no longer has {where}.{attribute} ({why})"
        assert _resolve_by(backend, by) is not None, f"{by}, for {where}.{attribute}"
    for where, attribute, why in reads:
        assert why
        assert _resolve(where, attribute) is not None, \
            f"Keras no longer has {where}.{attribute} ({why})"


@pytest.mark.backend_neutral
def test_a_missing_attribute_is_seen():
    assert _resolve("keras.src.layers.layer", "Layer._tracker") is not None  # instance
    assert _resolve("keras.src.layers.layer", "Layer._no_such_thing") is None
    assert _resolve("keras.src.trainers.trainer", "Trainer.nope.more") is None


# -- (c) each package has exactly one table ----------------------------------------------
def _table_assignments(path):
    """The module-level names of PATCHES, READS and KERAS ``path`` assigns, with whether
    the value is one literal list (no concatenation of other tables)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in ("PATCHES", "READS", "KERAS"):
                    out[t.id] = isinstance(node.value, (ast.List, ast.Constant))
    return out


@pytest.mark.backend_neutral
def test_each_backend_package_has_exactly_one_table():
    """``PATCHES`` and ``READS`` are assigned once per package, in its keras_fixes.py, as
    one literal list each; the role modules beside it hold no table; a row is
    (module, attribute, by, why), a READS row (module, attribute, why)."""
    holders = sorted(path.relative_to(PACKAGE.parent).as_posix()
                     for path in PACKAGE.rglob("*.py") if _table_assignments(path))
    assert holders == sorted(f"kmgpu/engines/{b + '/' if b else ''}keras_fixes.py"
                             for b in REGISTRIES), holders
    for backend, module in REGISTRIES.items():
        path = ENGINES / (backend or "") / "keras_fixes.py"
        assert _table_assignments(path) == {"KERAS": True, "PATCHES": True, "READS": True}
        patches, reads = _tables(backend)
        assert all(len(row) == 4 and all(isinstance(x, str) for x in row) for row in patches)
        assert all(len(row) == 3 and all(isinstance(x, str) for x in row) for row in reads)
        keys = [row[:2] for row in patches + reads]
        assert len(keys) == len(set(keys)), f"{module}: a row twice"


@pytest.mark.backend_neutral
def test_every_attribute_a_role_module_swaps_or_installs_is_a_patch():
    """``swapped((owner, "name", make))`` and ``install(owner, "name", make)`` with the
    name written out: the name is the attribute of a PATCHES row of the package or the
    shared one (Python's own, like ``__code__``, aside)."""
    wrong = []
    for path in sorted(p for p in PACKAGE.rglob("*.py") if _is_registry(p)):
        backend = _backend_of(path)
        names = {row[1].rpartition(".")[2] for which in {None, backend}
                 for row in _tables(which)[0]}
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            named = (node.args[1:2] if called == "install" else
                     [a.elts[1] for a in node.args if isinstance(a, ast.Tuple)
                      and len(a.elts) > 1] if called == "swapped" else [])
            for name in named:
                if isinstance(name, ast.Constant) and not name.value.startswith("__") \
                        and name.value not in names:
                    wrong.append(f"{path.name}:{node.lineno} {name.value}")
    assert not wrong, "swapped or installed without a PATCHES row: " + ", ".join(wrong)


@pytest.mark.backend_neutral
def test_keras_internals_are_used_only_in_registry_modules():
    """``keras.src`` is imported or named only in a ``keras_fixes.py`` or a role module
    beside one (``*_fixes.py``)."""
    users = sorted(path.relative_to(PACKAGE.parent).as_posix()
                   for path in PACKAGE.rglob("*.py")
                   if "keras.src" in path.read_text().replace("``keras.src``", "")
                   and not _is_registry(path))
    assert users == [], f"keras.src used outside the registry modules: {users}"


# -- (d) every row's Keras behaviour has a named test -------------------------------------
TESTS = PACKAGE.parent / "tests"


def behaviour_tests():
    """{(registry, module, attribute): ["path::test", ...]} from every ``@relies_on(...)``
    of the behaviour tests, read from their source (no backend imported): those of
    tests/unit/test_keras_behaviour.py cover the shared registry's rows, those of
    tests/<backend>/test_keras_behaviour.py that backend's."""
    found = {}
    for path in sorted(TESTS.rglob("test_keras_behaviour.py")):
        folder = path.parent.name
        registry = None if folder == "unit" else folder
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "relies_on":
                    for arg in dec.args:
                        module, attribute = ast.literal_eval(arg)
                        found.setdefault((registry, module, attribute), []).append(
                            f"{rel}::{node.name}")
    return found


#: PATCHES rows whose Keras behaviour has no test of its own yet: (registry, module,
#: attribute); each leaves this set when a behaviour test names it (relies_on)
NOT_YET = set()


@pytest.mark.backend_neutral
def test_every_patch_row_has_a_behaviour_test():
    """Each PATCHES row's Keras behaviour (what Keras does there, the row's ``why``) is
    checked by a test that names the row (``tests/relies_on.py``), so a Keras that changes
    it fails that test; every ``relies_on`` names a row of its folder's registry."""
    rows = {(backend, row[0], row[1]) for backend in REGISTRIES
            for row in _tables(backend)[0]}
    covered = behaviour_tests()
    unknown = sorted(f"{tests[0]}: {key}" for key, tests in covered.items() if key not in rows)
    assert not unknown, "relies_on names no PATCHES row of its registry: " + ", ".join(unknown)
    missing = sorted(str(key) for key in rows - set(covered) - NOT_YET)
    assert not missing, "PATCHES rows without a behaviour test: " + ", ".join(missing)
    stale = sorted(str(key) for key in NOT_YET & set(covered))
    assert not stale, "covered now, remove from NOT_YET: " + ", ".join(stale)
    gone = sorted(str(key) for key in NOT_YET - rows)
    assert not gone, "no such row, remove from NOT_YET: " + ", ".join(gone)


# -- the one way kmgpu changes Keras ------------------------------------------------------
class _Base:
    def inherited(self):
        return "base"


class _Owner(_Base):
    def own(self):
        return "own"


def test_swapped_nests_and_puts_back():
    module = types.ModuleType("example")
    module.f = original = lambda: "keras"
    made = []

    def make(before):
        made.append(before)
        return lambda: "kmgpu"

    with keras_fixes.swapped((module, "f", make)):
        assert module.f() == "kmgpu"
        with keras_fixes.swapped((module, "f", lambda before: lambda: "inner")):
            assert module.f() == "kmgpu"  # a nested block keeps the outer replacement
        assert module.f() == "kmgpu"  # the inner block's end leaves it
    assert module.f is original and made == [original]
    with pytest.raises(RuntimeError):
        with keras_fixes.swapped((module, "f", make)):
            raise RuntimeError("in the block")
    assert module.f is original and not keras_fixes._ACTIVE


def test_swapped_deletes_an_inherited_attribute_and_leaves_nothing_half_done():
    with keras_fixes.swapped((_Owner, "inherited", lambda before: lambda self: "swapped")):
        assert _Owner().inherited() == "swapped"
    assert "inherited" not in vars(_Owner) and _Owner().inherited() == "base"

    def fails(before):
        raise ValueError("cannot make it")

    with pytest.raises(ValueError):
        with keras_fixes.swapped((_Owner, "own", lambda before: lambda self: "new"),
                                 (_Owner, "inherited", fails)):
            pass
    assert _Owner().own() == "own" and "inherited" not in vars(_Owner)
    assert not keras_fixes._ACTIVE


def test_install_sets_for_good_once_per_key():
    owner, module = _Owner(), types.ModuleType("example")
    module.g = lambda: 1
    assert keras_fixes.install(owner, "own", lambda before: lambda: before() + "!",
                               key="loud")
    assert not keras_fixes.install(owner, "own", lambda before: lambda: "again", key="loud")
    assert owner.own() == "own!" and "own" in vars(owner)
    assert keras_fixes.install(owner, "own", lambda before: lambda: before() + "?")
    assert owner.own() == "own!?" and _Owner().own() == "own"
    keras_fixes.install(module, "g", lambda before: lambda: before() + 1, key="plus")
    keras_fixes.install(module, "g", lambda before: lambda: before() + 1, key="plus")
    assert module.g() == 2

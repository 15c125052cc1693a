"""One source for ``parallelize``'s arguments: its signature and docstring (kmgpu/api.py).

The README's argument table names every argument in the signature's order, with the
signature's default and the values the docstring allows; every ``parallelize(...)`` call
in a Python block of the README or a docs page uses only arguments the signature has,
with values the code accepts; a page that writes `name=value` for an argument with a
fixed set of values uses one of them, and one that calls a value the default says the
signature's. The docstring's values are the code's (plan.py's choices, hardware.py's
"every device" spellings).

Text only: the files are parsed (ast, regular expressions), nothing imports a backend.
"""

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.backend_neutral  # the same files in every backend's session

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
REQUIRED = object()

#: arguments whose values are a fixed set in the code: (file, constant)
CHOICES = {"batch": ("plan.py", "BATCH_POLICIES"), "shard": ("plan.py", "SHARD_CHOICES"),
           "reset_states": ("plan.py", "RESET_CHOICES"), "gpus": ("hardware.py", "ALL_DEVICES")}


def _function(path, name):
    tree = ast.parse((ROOT / "kmgpu" / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _constant(path, name):
    tree = ast.parse((ROOT / "kmgpu" / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not in kmgpu/{path}")


def _signature():
    """{argument: default} of ``parallelize``, in order (REQUIRED: no default)."""
    args = _function("api.py", "parallelize").args
    positional = args.posonlyargs + args.args
    defaults = [REQUIRED] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    out = dict(zip((a.arg for a in positional), defaults))
    out.update((a.arg, REQUIRED if d is None else ast.literal_eval(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults))
    return out


def _docstring():
    """{argument: its text} from the docstring's Args section."""
    text = ast.get_docstring(_function("api.py", "parallelize"))
    section = text.split("Args:", 1)[1].split("Returns:", 1)[0]
    out, name = {}, None
    for line in section.splitlines():
        match = re.match(r"    (\w+): (.*)", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2)
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def _values(text):
    """The literal values a text names: quoted strings, and -1 written bare."""
    quoted = {a or b for a, b in re.findall(r"\"([^\"]*)\"|(?<!\w)'([^']*)'(?!\w)", text)}
    return quoted | set(re.findall(r"(?<![\w.])-1(?![\w.])", text))


def _readme_rows():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## `parallelize` and its arguments"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `(\w+)` \| ([^|]+) \| (.*) \|$", section, re.M)


def _shown(default):
    return "(required)" if default is REQUIRED else f"`{default!r}`".replace("'", '"')


def test_the_docstring_describes_every_argument_and_no_other():
    assert list(_docstring()) == list(_signature())


def test_the_docstring_names_the_values_the_code_accepts():
    docs = _docstring()
    for name, (path, constant) in CHOICES.items():
        accepted = _constant(path, constant)
        named = _values(docs[name])
        for value in accepted:
            assert (value is None and "None" in docs[name]) or str(value) in named, (
                f"{name}: the docstring does not name {value!r}, which kmgpu/{path} accepts")
        if name != "gpus":  # gpus also takes ids and dicts, whose keys are quoted
            extra = named - {str(v) for v in accepted}
            assert not extra, f"{name}: the docstring names {extra}, which the code refuses"


def test_the_readme_table_is_the_signature_and_the_docstring():
    signature, docs = _signature(), _docstring()
    rows = _readme_rows()
    assert [r[0] for r in rows] == list(signature), "the table's arguments, in order"
    for name, default, what in rows:
        assert default == _shown(signature[name]), (name, default)
        assert _values(what) == _values(docs[name]), (
            f"{name}: the README names {sorted(_values(what))}, the docstring "
            f"{sorted(_values(docs[name]))}")


def _python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def _calls(source):
    """Every ``parallelize(...)`` call in ``source`` (a page's block or inline code)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        getattr(n.func, "attr", None) == "parallelize" or getattr(n.func, "id", None)
        == "parallelize")]


def _allowed(name, value):
    if name in CHOICES:
        accepted = _constant(*CHOICES[name])
        return value in accepted or (name == "gpus" and not isinstance(value, str))
    default = _signature()[name]
    if isinstance(default, bool):
        return isinstance(value, bool)
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_calls_parallelize_as_the_signature_allows(page):
    text = page.read_text()
    signature = _signature()
    sources = _python_blocks(text) + re.findall(r"`((?:kmgpu\.)?parallelize\([^`]*\))`", text)
    for source in sources:
        for call in _calls(source):
            for keyword in call.keywords:
                assert keyword.arg in signature, (
                    f"{page.name}: parallelize has no argument {keyword.arg!r}")
                if isinstance(keyword.value, ast.Constant) or (
                        isinstance(keyword.value, ast.UnaryOp)):
                    value = ast.literal_eval(keyword.value)
                    assert _allowed(keyword.arg, value), (
                        f"{page.name}: {keyword.arg}={value!r} is not a value it takes")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_writes_values_and_defaults_the_code_has(page):
    text = page.read_text()
    signature = _signature()
    for name, value in re.findall(r"`(\w+)=([^`=]+)`", text):
        if name not in signature or value.strip().startswith(("...", "N")):
            continue
        try:
            literal = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            continue
        assert _allowed(name, literal), f"{page.name}: `{name}={value}` is not a value it takes"
    for name, value in re.findall(r"`(\w+)=([^`]+)`,? (?:\((?:the )?default\)|the default|"
                                  r"default\b)", text):
        if name in signature:
            assert ast.literal_eval(value) == signature[name], (
                f"{page.name}: `{name}={value}` is called the default; the signature's is "
                f"{signature[name]!r}")

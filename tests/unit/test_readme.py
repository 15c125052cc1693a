"""What a newcomer reads stays true: the README is short and names every argument of
``parallelize`` with its default, every install extra and the two set-up commands, and its
links lead somewhere; the docs' design page names every kmgpu module, the benchmarks page
every benchmark script, the settings page every KMGPU_* variable kmgpu reads."""

import inspect
import pathlib
import re

import pytest

pytestmark = pytest.mark.backend_neutral  # the same files in every backend's session

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(text, title):
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _words(text):
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_the_readme_names_every_argument_of_parallelize_with_its_default():
    from kmgpu import api

    table = _section(README, "`parallelize` and its arguments")
    for name, p in inspect.signature(api.parallelize).parameters.items():
        default = "(required)" if p.default is p.empty else f"`{p.default!r}`".replace("'", '"')
        assert f"| `{name}` | {default} |" in table, (name, default)


def test_the_readme_says_how_to_install_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    install = _section(README, "Install")
    for extra in ("jax", "torch", "tensorflow", "all"):
        assert extra in extras, extra
        assert f"kmgpu[{extra}]" in install, extra


def test_the_readme_gives_the_two_set_up_commands():
    commands = _section(README, "Two commands")
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in commands and (ROOT / script).is_file(), script


def test_the_readme_links_lead_somewhere():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_the_design_page_names_every_module():
    design = _section((ROOT / "docs" / "design.md").read_text(), "Every module")
    words = _words(design)
    missing = []
    for path in sorted((ROOT / "kmgpu").rglob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if path.stem not in words or folder not in design:
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"docs/design.md's 'Every module' does not name: {', '.join(missing)}"


def test_the_benchmarks_page_names_every_benchmark_script():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) + sorted(
        (ROOT / "benchmarks").glob("*.sh")) if f"`{p.name}`" not in page]
    assert not missing, f"docs/benchmarks.md does not name: {', '.join(missing)}"


def test_the_lab_readme_names_every_probe_and_no_script_is_long():
    """benchmarks/ holds what a user runs; the development probes are in benchmarks/lab/,
    one README line each; no script or page there is over 500 lines (run outputs, JSON
    and logs, are data, not read as text)."""
    lab = ROOT / "benchmarks" / "lab"
    page = (lab / "README.md").read_text()
    missing = [p.name for p in sorted(lab.glob("*.py")) if f"`{p.name}`" not in page]
    assert not missing, f"benchmarks/lab/README.md does not name: {', '.join(missing)}"
    long = [p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*")
            if p.suffix in (".py", ".sh", ".md") and len(p.read_text().splitlines()) > 500]
    assert not long, f"over 500 lines: {', '.join(long)}"


def test_the_settings_page_names_every_environment_variable():
    used = set()
    for path in (ROOT / "kmgpu").rglob("*.py"):
        used |= set(re.findall(r"KMGPU_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = sorted(v for v in used if f"`{v}`" not in page)
    assert not missing, f"docs/settings.md does not name: {', '.join(missing)}"


def test_the_troubleshooting_page_names_every_warning():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    for path in (ROOT / "kmgpu").rglob("*.py"):
        for text in re.findall(r"warnings\.warn\(\s*f?\"kmgpu: ([^\"{]{12,40})", path.read_text()):
            assert text.strip() in page, (path.name, text)

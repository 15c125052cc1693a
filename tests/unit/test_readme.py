"""What a newcomer reads first stays true: the README's Layout names every kmgpu module
and benchmark script, and it says how to install each backend's extra."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _section(title):
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_layout_names_every_module_and_benchmark_script():
    layout = _section("Layout")
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", layout))
    missing = []
    for path in sorted((ROOT / "kmgpu").rglob("*.py")):
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if path.stem not in words or folder.split("/")[-2] not in layout:
            missing.append(path.relative_to(ROOT).as_posix())
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem not in words:
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"README.md's Layout does not name: {', '.join(missing)}"


def test_the_readme_says_how_to_install_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    install = _section("Install")
    for extra in ("jax", "torch", "tensorflow", "all"):
        assert extra in extras, extra
        assert f"kmgpu[{extra}]" in install, extra
    assert "kmgpu bench --quick" in (ROOT / "README.md").read_text()

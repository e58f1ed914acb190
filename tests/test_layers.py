"""The layers import downward only, and never another top package's private module.

Every module's imports are read with ``ast`` (those inside functions too): the engine
(``mmproxy``, its command line, apps and test helpers aside) imports neither the datasets, the
pipelines nor the command line; the pipelines do not import the datasets; and no module of one
of the three top packages imports a private module (a name starting with ``_``) of another.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Top package -> its folder, longest name first so that a dotted name finds its own.
FOLDERS = {"mmproxy.datasets": "datasets", "mmproxy.pipelines": "pipelines", "mmproxy": "mmproxy"}
# The engine's modules that sit above the datasets and the pipelines.
ABOVE = ("mmproxy.apps", "mmproxy.cli", "mmproxy._commands", "mmproxy.testing")
# What a layer may not import, by top package.
BELOW_ONLY = {
    "mmproxy": ("mmproxy.datasets", "mmproxy.pipelines", *ABOVE),
    "mmproxy.pipelines": ("mmproxy.datasets",),
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join([package, *parts]), path))
    return found


def top_package(name: str) -> str | None:
    """The top package a dotted module name belongs to (None: not mmproxy's)."""
    for package in FOLDERS:
        if name == package or name.startswith(package + "."):
            return package
    return None


def private_part(name: str) -> str | None:
    """The private module a dotted name passes through below its top package (None: none)."""
    package = top_package(name)
    if package is None:
        return None
    parts = name.split(".")
    for depth in range(package.count(".") + 1, len(parts)):
        if parts[depth].startswith("_"):
            return ".".join(parts[: depth + 1])
    return None


def is_private(name: str) -> bool:
    """Whether a module name passes through a private part below its top package."""
    return private_part(name) is not None


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """The module names a module imports, with their lines (``from X import y``: X.y and X)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return found


def violations() -> list[str]:
    found = []
    for module, path in _modules():
        home = top_package(module)
        banned = () if module.startswith(ABOVE) else BELOW_ONLY.get(home or "", ())
        for name, line in imports(module, path):
            target = top_package(name)
            if target is None:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            private = private_part(name)
            if target != home and private:
                found.append(f"{where}: {module} imports {private}, a private module of {target}")
            for above in banned:
                if name == above or name.startswith(above + "."):
                    found.append(f"{where}: {module} imports {above}, a layer above it")
    return sorted(set(found))


def test_no_private_or_upward_imports():
    found = violations()
    assert not found, "layer violations:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "name, package, private",
    [
        ("mmproxy._install", "mmproxy", True),
        ("mmproxy.datasets.checks", "mmproxy.datasets", False),
        ("mmproxy.datasets._tar", "mmproxy.datasets", True),
        ("mmproxy.pipelines.video.CPU_CODECS", "mmproxy.pipelines", False),
        ("mmproxy.media._headers", "mmproxy", True),
        ("numpy._core", None, False),
    ],
)
def test_names_are_placed(name, package, private):
    assert top_package(name) == package
    assert is_private(name) is private


def test_relative_imports_are_resolved(tmp_path):
    module = tmp_path / "video.py"
    module.write_text("from ._pyav import decode_clip\nfrom .. import datasets\n", encoding="utf-8")
    found = {name for name, _ in imports("mmproxy.pipelines.video", module)}
    assert "mmproxy.pipelines._pyav.decode_clip" in found
    assert "mmproxy.datasets" in found


def test_imports_inside_functions_are_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from mmproxy.datasets._tar import x\n", encoding="utf-8")
    assert ("mmproxy.datasets._tar", 2) in imports("mmproxy.pipelines.m", module)


def test_every_package_folder_is_installed():
    """A regular install takes the packages pyproject.toml lists: every folder with an
    ``__init__.py`` under the three top packages is one of them."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module for module, path in _modules() if path.name == "__init__.py"}
    assert found == listed, (sorted(found - listed), sorted(listed - found))

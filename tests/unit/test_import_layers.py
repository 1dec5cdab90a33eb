"""Every megarl package imports only the packages below it (function-level imports included).

The order is the architecture read bottom-up: shared types and pure decisions at the bottom,
the device-facing layers above them, the rank loop and the command line on top. A new import
that points upward (a circle in waiting) fails here with the file and the two packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"

LAYERS = (
    "errors",
    "user_code",
    "batch",
    "algo",
    "planner",
    "data",
    "distributed",
    "models",
    "export",
    "engines",
    "agent",
    "sft",
    "config",
    "checkpoint",
    "actor",
    "critic",
    "trainer",
    "train",
)
"""Bottom first: a package may import only packages that come before it."""


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = node.module.split(".")
            if names[0] != "megarl":
                continue
            found.update([names[1]] if len(names) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("megarl."))
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if _package_of(p) != "__init__")


def test_every_package_has_a_layer() -> None:
    missing = {_package_of(p) for p in SOURCES} - set(LAYERS)
    assert not missing, f"add {sorted(missing)} to LAYERS at the right height"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_imports_point_down(path: Path) -> None:
    own = _package_of(path)
    height = LAYERS.index(own)
    upward = sorted(
        target
        for target in _imported_packages(path) - {own}
        if target in LAYERS and LAYERS.index(target) > height
    )
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports upward: {upward}"

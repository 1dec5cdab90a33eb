"""The pure modules import no distributed machinery, directly or through other megarl modules.

Planner, gates, advantages, losses, mappings and config validation are unit-tested on plain data
in milliseconds and called at start-up before any process group exists; that holds only while
they import no megatron, transformer-engine, ray, vLLM or ``torch.distributed``. This test reads
source (no import, no subprocess). In a pure module every import statement counts, also one
inside a function, except under ``if TYPE_CHECKING:``. The megarl modules it imports, and the
``__init__.py`` of every package on the way, are followed for what importing them runs: their
statements outside function bodies.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megarl"

PURE_MODULES = sorted(
    [
        *(PACKAGE / "algo").glob("*.py"),
        *(PACKAGE / "config").glob("*.py"),
        *(PACKAGE / "data").glob("*.py"),
        *(PACKAGE / "planner").glob("*.py"),
        PACKAGE / "agent" / "driver.py",
        PACKAGE / "agent" / "gateway" / "agent_loop.py",
        PACKAGE / "agent" / "gateway" / "protocol.py",
        PACKAGE / "agent" / "gateway" / "sessions.py",
        PACKAGE / "agent" / "gateway" / "settings.py",
        PACKAGE / "agent" / "loop.py",
        PACKAGE / "agent" / "metrics.py",
        PACKAGE / "agent" / "render.py",
        PACKAGE / "agent" / "sandbox" / "landlock.py",
        PACKAGE / "agent" / "sandbox" / "seccomp.py",
        PACKAGE / "agent" / "tool_calls.py",
        PACKAGE / "agent" / "tool_config.py",
        PACKAGE / "agent" / "trajectory.py",
        PACKAGE / "agent" / "tools" / "base.py",
        PACKAGE / "agent" / "tools" / "calculator.py",
        PACKAGE / "actor" / "training_loss.py",
        PACKAGE / "critic" / "model_source.py",
        PACKAGE / "critic" / "value_stats.py",
        PACKAGE / "distributed" / "batch_invariant.py",
        PACKAGE / "distributed" / "execution.py",
        PACKAGE / "engines" / "base.py",
        PACKAGE / "engines" / "batching.py",
        PACKAGE / "engines" / "sampling.py",
        PACKAGE / "engines" / "vllm_settings.py",
        PACKAGE / "engines" / "vllm_weights.py",
        PACKAGE / "models" / "mapping.py",
        PACKAGE / "models" / "spec.py",
        PACKAGE / "sft" / "conversations.py",
        PACKAGE / "user_code.py",
    ]
)
FORBIDDEN = ("megatron", "transformer_engine", "ray", "vllm", "torch.distributed")


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def imported_names(source: str, in_functions: bool = True) -> set[str]:
    """Every dotted name an import statement of ``source`` can load at run time; with
    ``in_functions=False`` only those that importing ``source`` runs.

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a submodule).
    """
    names: set[str] = set()
    function = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node) or (not in_functions and isinstance(node, function)):
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def _megarl_files(name: str) -> list[Path]:
    """The files importing ``name`` executes: each package's ``__init__.py``, then the module."""
    parts = name.split(".")
    bases = [ROOT.joinpath(*parts[:depth]) for depth in range(1, len(parts) + 1)]
    candidates = [
        path for base in bases for path in (base / "__init__.py", base.with_suffix(".py"))
    ]
    return [path for path in candidates if path.is_file()]


def forbidden_imports(start: Path) -> dict[str, list[str]]:
    """``{forbidden package: [chain of files that imports it]}`` for the module at ``start``."""
    found: dict[str, list[str]] = {}
    first = _megarl_files(".".join(start.relative_to(ROOT).with_suffix("").parts))
    chains = {path: [path.relative_to(ROOT).as_posix()] for path in first}
    queue = list(first)
    seen: set[Path] = set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_names(path.read_text(), in_functions=path == start):
            banned = next((b for b in FORBIDDEN if name == b or name.startswith(b + ".")), None)
            if banned is not None:
                found.setdefault(banned, chains[path])
            elif name == "megarl" or name.startswith("megarl."):
                for nxt in _megarl_files(name):
                    if nxt not in chains:
                        chains[nxt] = [*chains[path], nxt.relative_to(ROOT).as_posix()]
                    queue.append(nxt)
    return found


@pytest.mark.parametrize("path", PURE_MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pure_module_imports_no_distributed_machinery(path: Path):
    assert path.is_file(), f"{path} is listed as pure but does not exist: update PURE_MODULES"
    found = forbidden_imports(path)
    assert not found, "\n".join(
        f"{name} imported via {' -> '.join(chain)}" for name, chain in sorted(found.items())
    )


def test_scanner_sees_lazy_imports_and_skips_type_checking_blocks():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    import ray\n"
        "def f():\n"
        "    from megatron.core import parallel_state\n"
        "    import torch.distributed as dist\n"
    )
    names = imported_names(source)
    assert {"megatron.core", "megatron.core.parallel_state", "torch.distributed"} <= names
    assert "ray" not in names
    assert imported_names(source, in_functions=False) == {"typing", "typing.TYPE_CHECKING", "torch"}


def test_scanner_follows_megarl_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "megarl"
    (package / "pure").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pure" / "__init__.py").write_text("")
    (package / "heavy.py").write_text("import vllm\n")
    (package / "pure" / "a.py").write_text("from megarl import heavy\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = forbidden_imports(package / "pure" / "a.py")
    assert found == {"vllm": ["megarl/pure/a.py", "megarl/heavy.py"]}

"""The layout's promises, checked on the source: launch/ reaches the trainer through trainer.contract
only, and no library file grows past 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def trainer_imports(path: Path) -> set[str]:
    """The trainer modules a file imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            found.add(node.module if node.module != "trainer" else f"trainer.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "trainer"}
    return found


def test_the_launcher_imports_the_trainer_only_through_its_contract():
    crossing = {f"{path.relative_to(REPO)}: {module}" for path in (REPO / "launch").rglob("*.py")
                for module in trainer_imports(path) if module != "trainer.contract"}
    assert not crossing, sorted(crossing)


def test_no_library_file_is_over_400_lines():
    long = {f"{path.relative_to(REPO)}: {n}" for package in ("trainer", "data", "launch")
            for path in (REPO / package).rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long, sorted(long)

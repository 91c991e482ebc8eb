"""The layout's promises: launch/ reaches the trainer through trainer.contract only, no library file
grows past 400 lines, and the config (with the model's arguments) imports first and without torch."""

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


def test_the_config_and_the_model_arguments_import_first_in_a_fresh_interpreter_without_torch():
    """Any of them may be a program's first import (trainer.model.args and trainer.config import each
    other's modules: an eager package `__init__` made that a cycle), and none of them loads torch."""
    import subprocess
    import sys

    for module in ("trainer.model.args", "trainer.config.schema", "trainer.config.groups", "trainer.config"):
        code = (f"import sys, {module}; from trainer.config import Config, ConfigError, load; "
                "from trainer.model.args import ModelArgs; assert 'torch' not in sys.modules, 'torch loaded'")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"import {module} first:\n{proc.stderr[-2000:]}"

"""The layout's promises: common/ is the bottom (it imports none of the project's other packages, nor
torch), data/ imports neither the trainer nor the launcher, launch/ reaches the trainer through
trainer.contract only, every package's docstring lists its modules, no library file grows past 400 lines,
and the config (with the model's arguments) imports first and without torch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "trainer", "data", "launch")


def project_imports(path: Path, packages: tuple[str, ...] = PACKAGES) -> set[str]:
    """The modules of `packages` a file imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
            found.add(node.module if "." in node.module else f"{node.module}.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in packages}
    return found


def crossings(package: str, allowed) -> list[str]:
    """`file: module` for each project module a file of `package` imports that `allowed(module)` refuses."""
    return sorted(f"{path.relative_to(REPO)}: {module}" for path in (REPO / package).rglob("*.py")
                  for module in project_imports(path) if not allowed(module))


def test_common_imports_nothing_of_the_other_packages_nor_torch():
    import subprocess
    import sys

    assert not (found := crossings("common", lambda module: module.split(".")[0] == "common")), found
    modules = sorted(f"common.{p.stem}" for p in (REPO / "common").glob("*.py") if p.name != "__init__.py")
    code = (f"import sys, {', '.join(modules)}, trainer.recovery.keys, trainer.contract; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_data_imports_neither_the_trainer_nor_the_launcher():
    assert not (found := crossings("data", lambda module: module.split(".")[0] in ("common", "data"))), found


def test_the_launcher_imports_the_trainer_only_through_its_contract():
    allowed = lambda module: module == "trainer.contract" or module.split(".")[0] in ("common", "launch")
    assert not (found := crossings("launch", allowed)), found


def test_every_package_docstring_lists_its_modules():
    """Each package's `__init__` docstring is its index: every module file and subpackage is named there."""
    missing = []
    for package in PACKAGES:
        for init in sorted((REPO / package).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            names = [p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"]
            names += [p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()]
            missing += [f"{init.parent.relative_to(REPO)}: {name}" for name in sorted(names)
                        if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", doc)]
    assert not missing, missing


def test_no_library_file_is_over_400_lines():
    long = {f"{path.relative_to(REPO)}: {n}" for package in PACKAGES
            for path in (REPO / package).rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long, sorted(long)


# Declarations of the config schema: one field per key, as many as the group has.
CONFIG_DECLARATIONS = ("trainer/config/", "trainer/model/args.py")


def library_trees():
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text())


def instance_fields(cls: ast.ClassDef) -> set[str]:
    """The names a class declares (annotated in its body) or sets on `self` anywhere in it."""
    names = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target,
                                                                                                       ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    names.add(item.attr)
    return names


def test_functions_classes_and_constructors_stay_small():
    """No function over 60 lines; no class but the config declarations with more than 12 fields; no
    constructor with more than 7 parameters."""
    found = []
    for name, tree in library_trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (length := node.end_lineno - node.lineno + 1) > 60:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
                if node.name == "__init__" and (n := len(node.args.args) + len(node.args.kwonlyargs) - 1) > 7:
                    found.append(f"{name}:{node.lineno} {node.name}: {n} parameters")
            elif isinstance(node, ast.ClassDef) and not name.startswith(CONFIG_DECLARATIONS):
                if (n := len(instance_fields(node))) > 12:
                    found.append(f"{name}:{node.lineno} class {node.name}: {n} fields")
    assert not found, found


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

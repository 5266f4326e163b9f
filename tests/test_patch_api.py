"""The package's own shape: names that resolve to what they say, installed code that stands without the test tree,
and the error a user gets for a family the patch does not support."""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import pytest
from transformers import AutoConfig

import patches
from patches import UnsupportedModelError, check_supported

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_no_export_shadows_a_submodule():
    """`patches.<name>` is the submodule wherever one exists (`import patches.sequence_parallel as sp` included)."""
    for info in pkgutil.iter_modules(patches.__path__):
        module = importlib.import_module(f"patches.{info.name}")
        assert getattr(patches, info.name) is module, f"patches.{info.name} is {getattr(patches, info.name)!r}"
    import patches.sequence_parallel as sequence_parallel_module
    assert sequence_parallel_module is sys.modules["patches.sequence_parallel"]


def installed_sources() -> list[Path]:
    """The .py files of the packages pyproject.toml installs (its setuptools `include` patterns)."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    roots = {path for pattern in patterns for path in ROOT.glob(pattern.split(".")[0]) if (path / "__init__.py").exists()}
    return sorted(source for root in roots for source in root.rglob("*.py"))


def test_installed_code_does_not_read_the_test_tree():
    """No installed module imports a module of tests/ or names the tests folder in code (comments and docstrings may
    mention tests)."""
    test_modules = {path.stem for path in TESTS.glob("*.py")} | {"tests"}
    sources = installed_sources()
    assert any(path.parent.name == "patches" for path in sources)
    for path in sources:
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported = {node.module.split(".")[0]}
            else:
                imported = set()
            assert not imported & test_modules, f"{path.relative_to(ROOT)}:{node.lineno} imports the test tree"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert not re.search(r"(^|[/\\])tests([/\\]|$)", node.value), \
                    f"{path.relative_to(ROOT)}:{node.lineno} names the tests folder"


@pytest.mark.parametrize("model_type, why", [("opt", "MLP as submodules"), ("gptj", "attention interface")])
def test_unsupported_family_says_why_in_one_line(model_type, why):
    with pytest.raises(UnsupportedModelError) as error:
        check_supported(AutoConfig.for_model(model_type))
    message = str(error.value)
    print(message)
    assert "\n" not in message and len(message) < 320, "one short line"
    assert why in message and "docs/families.md" in message and "--no_bpt" in message
    assert not re.search(r"\b(llama|bloom|afmoe|AttentionInterface)\b", message), "no family list, no internal names"

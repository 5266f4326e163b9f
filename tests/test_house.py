"""The shape of the house, read statically (ast over the source tree; nothing imported, nothing run):

- the engine stays the core: no module of bpt/ outside bpt/bench/ imports patches or train, save bpt/__init__.py's
  lazy re-export of apply_bpt_patch for users (inside its module __getattr__); bpt/bench/ is the one tool that
  reaches up (it benchmarks the patch);
- no import circle among the modules of bpt/, patches/ and train/;
- no source file over 450 lines outside tests/;
- process groups are created in exactly one function (bpt/mesh.py mesh_groups).

Imports counted: every `import` / `from ... import` statement anywhere in a module, at module level or inside a
function (a function-level import runs when the function does, so it still binds the two modules together; a circle
through one is a circle in the design even when the interpreter tolerates it). `from pkg import name` counts as an
import of the module pkg.name when that is a module, else of pkg. A package's __init__.py running before its
submodules is not counted as an import of the package unless the package is named.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bpt", "patches", "train")
SOURCE_SUFFIXES = {".py", ".cpp", ".c", ".h", ".cu", ".sh"}
MAX_LINES = 450
# The calls that create process groups (torch.distributed and its device mesh).
GROUP_MAKERS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "init_device_mesh",
                "DeviceMesh"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> path, for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module of the three packages, the outermost function the import is in or None)}."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges = set()

        def visit(node, function):
            for child in ast.iter_child_nodes(node):
                inner = function
                if function is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = child.name
                targets = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                    targets = [f"{child.module}.{alias.name}" if f"{child.module}.{alias.name}" in modules
                               else child.module for alias in child.names]
                for target in targets:
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in modules and target != name:
                        edges.add((target, function))
                visit(child, inner)

        visit(tree, None)
        graph[name] = edges
    return graph


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_engine_imports_neither_patches_nor_train():
    modules = _modules()
    graph = _imports(modules)
    assert {"bpt", "bpt.mesh", "bpt.tensor_parallel", "bpt.bench.cli", "bpt.gpusim.shim"} <= modules.keys()
    up = sorted((module, target, function) for module, edges in graph.items() for target, function in edges
                if _top(module) == "bpt" and not module.startswith("bpt.bench") and _top(target) != "bpt")
    assert up == [("bpt", "patches", "__getattr__")], up  # the lazy re-export of apply_bpt_patch, only
    # patches does not reach up into train either
    assert not [(m, t) for m, edges in graph.items() for t, _ in edges if _top(m) == "patches" and _top(t) == "train"]


def test_no_import_circle():
    graph = {module: {target for target, _ in edges} for module, edges in _imports(_modules()).items()}
    done, active = set(), []

    def visit(module):
        if module in active:
            raise AssertionError(f"import circle: {' -> '.join(active[active.index(module):] + [module])}")
        if module in done:
            return
        active.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        active.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_source_file_over_450_lines_outside_tests():
    long = {}
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if path.suffix not in SOURCE_SUFFIXES or not path.is_file() or relative.parts[0] == "tests" \
                or any(part.startswith(".") or part in ("build", "dist") or part.endswith(".egg-info")
                       for part in relative.parts):
            continue
        if (lines := len(path.read_text().splitlines())) > MAX_LINES:
            long[str(relative)] = lines
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_process_groups_are_created_in_one_function():
    makers = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())

        def visit(node, function):
            for child in ast.iter_child_nodes(node):
                inner = function
                if function is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = child.name
                if isinstance(child, ast.Call):
                    called = child.func.attr if isinstance(child.func, ast.Attribute) else \
                        child.func.id if isinstance(child.func, ast.Name) else None
                    if called in GROUP_MAKERS:
                        makers.add((name, function))
                visit(child, inner)

        visit(tree, None)
    assert makers == {("bpt.mesh", "mesh_groups")}, makers


def test_the_moved_names_are_still_importable_where_users_found_them():
    """patches.tensor_parallel / patches.sequence_parallel re-export the layout and collectives that moved to bpt."""
    import bpt.mesh
    import bpt.tensor_parallel
    import patches.sequence_parallel
    import patches.tensor_parallel

    for name in ("tensor_parallel_group", "mesh_groups", "mesh_ranks"):
        assert getattr(patches.tensor_parallel, name) is getattr(bpt.mesh, name)
    for name in ("reduce_tensor_parallel_gradients", "clip_grad_norm_", "gathered_state_dict", "gather_param",
                 "slice_like", "MARKS"):
        assert getattr(patches.tensor_parallel, name) is getattr(bpt.tensor_parallel, name)
    assert patches.sequence_parallel.sequence_parallel_group is bpt.mesh.sequence_parallel_group

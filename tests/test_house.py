"""The shape of the house, read statically (ast over the source tree; nothing imported, nothing run):

- the engine stays the core: no module of bpt/ outside bpt/bench/ imports patches or train, save bpt/__init__.py's
  lazy re-export of apply_bpt_patch for users (inside its module __getattr__); bpt/bench/ is the one tool that
  reaches up (it benchmarks the patch);
- no import circle among the modules of bpt/, patches/ and train/;
- no source file over 450 lines outside tests/;
- process groups are created in exactly one function (bpt/mesh.py mesh_groups);
- train/ is in rooms (run, evaluation, recipe, parallel) whose imports run one way, down TRAIN_ROOMS, and no module
  imports a private name from another room; a model is placed in the process layout in one function
  (train/parallel/placement.py place_model), which train.qlora and train.eval both call.

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
# train/'s rooms, top down: an import from one to another runs down this list. At the top of train/ stand the
# `python -m` entries (above every room) and train.errors (below them all: the UserError every room raises).
TRAIN_ROOMS = ("train", "train.run", "train.evaluation", "train.recipe", "train.parallel", "train.errors")
TRAIN_ENTRIES = {"train", "train.qlora", "train.eval", "train.pretrain_tiny"}
# The calls that place a model in the process layout (slice, shard, hand to DeepSpeed, wrap in DDP) and where each
# may stand: place_model, or inside the one function that wraps the library's call.
PLACING = {"slice_model", "shard_model", "initialize", "prepare", "tensor_parallel", "fully_shard"}


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


def _nodes(path: Path):
    """(node, the outermost function it is in or None) of every node of a module."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = function
            if function is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            found.append((child, function))
            visit(child, inner)

    visit(ast.parse(path.read_text()), None)
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module of the three packages, the outermost function the import is in or None)}."""
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node, function in _nodes(path):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                           else node.module for alias in node.names]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.add((target, function))
        graph[name] = edges
    return graph


def _top(name: str) -> str:
    return name.split(".")[0]


def _room(module: str) -> str:
    """The room of a module of train/ (its entries' room is "train")."""
    return max((room for room in TRAIN_ROOMS if module == room or module.startswith(room + ".")), key=len)


def _calls(path: Path):
    """(called name, the outermost function the call is in or None) of every call in a module."""
    return {(node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id, function)
            for node, function in _nodes(path)
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))}


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
    makers = {(name, function) for name, path in _modules().items() for called, function in _calls(path)
              if called in GROUP_MAKERS}
    assert makers == {("bpt.mesh", "mesh_groups")}, makers


def test_train_is_in_rooms_whose_imports_run_one_way():
    modules = {name: path for name, path in _modules().items() if _top(name) == "train"}
    flat = sorted(name for name in modules if name.count(".") == 1 and name not in TRAIN_ROOMS and
                  modules[name].name != "__init__.py" and name not in TRAIN_ENTRIES)
    assert not flat, f"modules at the top of train/ that are neither an entry nor errors: put them in a room: {flat}"
    assert {_room(name) for name in modules} == set(TRAIN_ROOMS)
    order = {room: rank for rank, room in enumerate(TRAIN_ROOMS)}
    up = sorted(f"{module} -> {target}" for module, edges in _imports(modules).items() for target, _ in edges
                if order[_room(module)] > order[_room(target)])
    assert not up, f"imports up train/'s rooms (the order: {' -> '.join(TRAIN_ROOMS)}): {up}"


def test_no_private_name_crosses_a_room_of_train():
    modules = _modules()
    crossing = []
    for name, path in modules.items():
        if _top(name) != "train":
            continue
        bound = {}  # local name -> the module of train/ it names
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("train"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        bound[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and _room(node.module) != _room(name):
                        crossing.append(f"{name}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name for alias in node.names
                              if alias.asname and alias.name in modules and _top(alias.name) == "train"})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and _room(bound[node.value.id]) != _room(name):
                crossing.append(f"{name}: {bound[node.value.id]}.{node.attr}")
    assert not crossing, f"private names used across train/'s rooms (make them public or move them): {crossing}"


def test_a_model_is_placed_in_the_layout_in_one_function():
    """Slicing (TP), sharding (FSDP2), DeepSpeed's engine and accelerate's DDP wrapping are called in place_model
    only (each library call also inside the one function of ours that wraps it), and both commands place through it:
    train.qlora's run and train.eval's."""
    modules = {name: path for name, path in _modules().items() if _top(name) == "train"}
    placing = {(name, called, function) for name, path in modules.items() for called, function in _calls(path)
               if called in PLACING}
    assert placing == {
        ("train.parallel.placement", "slice_model", "place_model"),
        ("train.parallel.placement", "tensor_parallel", "slice_model"),  # patches.tensor_parallel's
        ("train.parallel.placement", "shard_model", "place_model"),
        ("train.parallel.fsdp", "fully_shard", "shard_model"),  # torch's
        ("train.parallel.placement", "initialize", "place_model"),
        ("train.parallel.deepspeed", "initialize", "initialize"),  # the deepspeed library's
        ("train.parallel.placement", "prepare", "place_model"),  # accelerate's (DDP)
    }, placing
    callers = {(name, function) for name, path in modules.items() for called, function in _calls(path)
               if called == "place_model"}
    assert callers == {("train.run.qlora", "run"), ("train.evaluation.eval", "run")}, callers


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

"""The code base's structure, read from the source (AST and text only: nothing here imports the
project's modules, except the light-import checks at the end, one of them in a subprocess: the
whole file runs in seconds).

- No import cycles among the project's modules (dsa_train and dsa_kernels, the top-level
  `dsa_kernels/` directory). The graph is built from every import statement of every module: module
  level, inside functions and under `if TYPE_CHECKING:` alike (an import hidden in a function is a
  dependency all the same). Edges, for a module M:
    * `import a.b.c` / `from a.b.c import name` -> a.b.c;
    * `from a.b import c` -> a.b.c when a.b.c is a module (Python imports the submodule; it needs
      only the package object, which exists while the package's `__init__` runs), else -> a.b
      (the name is read from the package's namespace, filled by its `__init__`);
    * relative imports resolved against M's package first;
    * and, for each target, every package above it (a, a.b) that does not contain M: Python runs
      those packages' `__init__` before the target, and what they import runs then too.
  A package containing M is no edge of M: it is already being imported when M runs (importing M
  starts with it). So a package's `__init__` importing (re-exporting) its submodules is not a
  cycle by itself; it is one when a submodule reads a name back from the package
  (`from a.b import name`, the name set by a/b/__init__), or when a module outside the package
  imports one of its submodules while the package's `__init__` imports, directly or not, that
  module (e.g. parallel/x -> trainer/schedule runs trainer/__init__ -> trainer/trainer -> parallel/x:
  importing parallel/x first fails on a partially initialized module).
  Every strongly connected component of more than one module is reported with one of its cycles.
- No class in dsa_train/ longer than MAX_CLASS_LINES lines (`class` line to its last line).
- No forward in dsa_train/model/ tests a module's type to pick a path: in every `forward` method
  and every method or module-level function of the same file it calls (`self.name(...)` /
  `name(...)`, followed transitively), no `type(x) is / == ...` test and no `isinstance(x, C)` with
  C a module class (`nn.*` / `torch.nn.*` or a class of the project deriving from one). Choosing a
  path belongs to construction time (`__init__`, `parallelize_model`), which is free to test types.
- The parameter / module attribute protocol of the layout (`allreduce`, `dsa_shard`,
  `group_name`, `dsa_parallel_state`, as attributes or as getattr/hasattr/setattr names) appears
  only in dsa_train/parallel/{layout,sharding,deepspeed_compat}.py.
- DeepSpeed's private names appear only in dsa_train/parallel/deepspeed_compat.py: names with a
  leading underscore imported from or reached through a deepspeed module, DeepSpeed's expert-group
  registry (`_EXPERT_*`), subclasses of DeepSpeed classes, and the attributes of DeepSpeed's engine,
  ZeRO optimizers and partitioned parameters that are no published API (DEEPSPEED_INTERNALS),
  read as attributes or by name.
- docs/architecture.md's package table is true: its rows name every package (and top-level
  module) of dsa_train and dsa_kernels once, and each row's "imports (project)" column names
  exactly the packages its code imports (the import graph above, per package; backticked names
  that are no package, such as class names, are prose).
- Fault injection is one seam: no `faults` name in the training loop (trainer/trainer.py) and, in
  the checkpoint writer (checkpoint/training.py), only the wrapper's factory and type
  (`checkpoint_faults`, `CheckpointFaults`, `NO_FAULTS`), imported from faults.py.
- Imports as light as the command: `dsa-train --help`, `import dsa_train` and `import dsa_train.data`
  load neither the model (dsa_train.model) nor the kernels (dsa_kernels, Triton), checked in a fresh
  interpreter; the package's lazy re-exports (PEP 562) still give the public API.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> source directory
PACKAGES = {"dsa_train": ROOT / "dsa_train", "dsa_kernels": ROOT / "dsa_kernels"}

MAX_CLASS_LINES = 300

LAYOUT_PROTOCOL = {"allreduce", "dsa_shard", "group_name", "dsa_parallel_state"}
LAYOUT_MODULES = {"dsa_train/parallel/layout.py", "dsa_train/sharding.py", "dsa_train/parallel/deepspeed_compat.py"}

DEEPSPEED_ADAPTER = "dsa_train/parallel/deepspeed_compat.py"
# attributes of DeepSpeed objects that are not its published API: the engine's reduction switch and
# ZeRO-stage method, the MoE layer's group hook, the ZeRO / BF16 optimizers' partitions and
# gradient buffers, ZeRO-3's partitioned-parameter fields
DEEPSPEED_INTERNALS = {
    "enable_backward_allreduce", "zero_optimization_stage", "set_deepspeed_parallelism",
    "fp32_partitioned_groups_flat", "bit16_groups", "grad_position", "get_param_id", "_get_param_partition_rank",
    "single_partition_of_fp32_groups", "fp32_groups_flat_partition", "_hp_mapping",
    "grads_in_partition", "grad_partitions_flat_buffer", "fp32_groups_gradients_flat", "all_grad_tensors",
    "averaged_gradients", "ds_numel", "ds_shape", "ds_tensor",
}


@dataclass(frozen=True)
class Module:
    name: str  # dotted import name: dsa_train.model.mla; a package is its __init__
    path: str  # relative to the repository root (messages)
    is_package: bool
    tree: ast.Module


def load_modules(sources: dict[str, tuple[str, str, bool]]) -> dict[str, Module]:
    """{name: (path, source text, is_package)} -> {name: Module}."""
    return {name: Module(name, path, is_package, ast.parse(text, filename=path))
            for name, (path, text, is_package) in sources.items()}


@functools.lru_cache(maxsize=1)
def project_modules() -> dict[str, Module]:
    sources = {}
    for top, directory in PACKAGES.items():
        for file in sorted(directory.rglob("*.py")):
            parts = [top, *file.relative_to(directory).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            sources[".".join(parts)] = (str(file.relative_to(ROOT)), file.read_text(), is_package)
    return load_modules(sources)


def in_dir(prefix: str) -> list[Module]:
    return [m for m in project_modules().values() if m.path.startswith(prefix)]


# ------------------------------------------------------------------------------ import graph
def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """module -> the project modules it imports (edges as the module docstring defines them)."""
    graph = {}
    for mod in modules.values():
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
                    elif base in modules:
                        targets.add(base)
        edges = set(targets)
        for target in targets:  # the packages Python initializes before the target
            parts = target.split(".")
            for n in range(1, len(parts)):
                above = ".".join(parts[:n])
                if above in modules and not (mod.name == above or mod.name.startswith(above + ".")):
                    edges.add(above)
        edges.discard(mod.name)
        graph[mod.name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        # shortest path start -> ... -> start inside the component (breadth first)
        previous, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        found = v
                        break
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        chain, v = [], found  # found -> ... -> start, back along the search
        while v is not None:
            chain.append(v)
            v = previous[v]
        cycles.append([*reversed(chain), start])
    return cycles


def test_the_import_graph_follows_the_documented_definition():
    modules = load_modules({
        "pkg": ("pkg/__init__.py", "from .a import helper\nfrom .b import Thing\n", True),
        "pkg.a": ("pkg/a.py", "from . import b\n\ndef helper():\n    from pkg.c import late\n", False),
        "pkg.b": ("pkg/b.py", "import os\nThing = 1\n", False),
        "pkg.c": ("pkg/c.py", "from .a import helper\nlate = 1\n", False),  # a -> c (in a function) -> a
        "pkg.d": ("pkg/d.py", "from pkg import Thing\n", False),  # reads a name re-exported by pkg/__init__
        "app": ("app/__init__.py", "", True),
        "app.main": ("app/main.py", "import pkg.b\n", False),  # runs pkg/__init__ first
    })
    graph = import_graph(modules)
    assert graph == {"pkg": {"pkg.a", "pkg.b"}, "pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": set(),
                     "pkg.c": {"pkg.a"}, "pkg.d": {"pkg"}, "app": set(), "app.main": {"pkg", "pkg.b"}}
    # the package re-exporting its submodules is no cycle; the function-level import is one
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.a"]]
    graph["pkg"].add("pkg.d")  # __init__ imports d, which reads a name back from __init__
    assert sorted(map(tuple, import_cycles(graph))) == [("pkg", "pkg.d", "pkg"), ("pkg.a", "pkg.c", "pkg.a")]
    # app.main imports pkg.c, so pkg/__init__ runs first; it imports b, which imports app.main:
    # importing app.main first fails (run is not defined yet), a cycle through the package
    graph = import_graph(load_modules({
        "pkg": ("pkg/__init__.py", "from .b import Thing\n", True),
        "pkg.b": ("pkg/b.py", "from app.main import run\nThing = 1\n", False),
        "pkg.c": ("pkg/c.py", "x = 1\n", False),
        "app": ("app/__init__.py", "", True),
        "app.main": ("app/main.py", "from pkg.c import x\n\ndef run():\n    pass\n", False),
    }))
    assert graph["app.main"] == {"pkg", "pkg.c"} and graph["pkg.b"] == {"app", "app.main"}
    assert import_cycles(graph) == [["app.main", "pkg", "pkg.b", "app.main"]]


def test_no_import_cycles():
    graph = import_graph(project_modules())
    assert len(graph) > 100 and "dsa_train.model.transformer" in graph and "dsa_kernels.ops" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (break them by moving the seam):\n" + "\n".join(" -> ".join(c) for c in cycles)


# ------------------------------------------------------------------------------ class size
def test_no_class_over_the_line_limit():
    long = []
    for mod in in_dir("dsa_train/"):
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{mod.path}:{node.lineno} class {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


# ------------------------------------------------------------------------------ model forwards
def dotted(node: ast.AST) -> str:
    """a.b.c for a Name / Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def module_classes() -> set[str]:
    """Names of the project's classes that derive from torch.nn.Module (directly or through
    another such class of the project)."""
    bases = {}
    for mod in in_dir("dsa_train/"):
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(dotted(b) for b in node.bases)
    found = {name for name, bs in bases.items() if any(b.startswith(("nn.", "torch.nn.")) for b in bs)}
    while True:
        more = {name for name, bs in bases.items() if bs & found} - found
        if not more:
            return found
        found |= more


def type_tests(fn: ast.AST, nn_classes: set[str]) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Call) and dotted(side.func) == "type":
                    out.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, ast.Call) and dotted(node.func) == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = [dotted(c) for c in classes]
            if any(n.startswith(("nn.", "torch.nn.")) or n in nn_classes for n in names):
                out.append((node.lineno, ast.unparse(node)))
    return out


def forward_paths(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(qualified name, function) of every `forward` of the file and of the methods / module-level
    functions they call by `self.name(...)` / `name(...)`, transitively."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    todo = []
    methods = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        methods[cls.name] = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        if "forward" in methods[cls.name]:
            todo.append((cls.name, "forward"))
    seen, out = set(), []
    while todo:
        owner, name = todo.pop()
        if (owner, name) in seen:
            continue
        seen.add((owner, name))
        fn = functions[name] if owner is None else methods[owner][name]
        out.append((name if owner is None else f"{owner}.{name}", fn))
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                callee = dotted(node.func)
                if owner is not None and callee.startswith("self.") and callee[5:] in methods[owner]:
                    todo.append((owner, callee[5:]))
                elif callee in functions:
                    todo.append((None, callee))
    return out


def test_model_forwards_pick_no_path_by_module_type():
    nn_classes = module_classes()
    assert {"MoE", "MLP", "DSAForCausalLM"} <= nn_classes
    found = []
    for mod in in_dir("dsa_train/model/"):
        for qualname, fn in forward_paths(mod.tree):
            found += [f"{mod.path}:{line} {qualname}: {text}" for line, text in type_tests(fn, nn_classes)]
    assert not found, "forward paths that test a module's type (decide at construction instead):\n" + "\n".join(found)


def test_the_forward_check_sees_a_type_test_behind_a_helper():
    tree = ast.parse(
        "class Block(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return self._route(x)\n"
        "    def _route(self, x):\n"
        "        return pick(self.mlp, x)\n"
        "def pick(m, x):\n"
        "    return x if isinstance(m, (Block, nn.Linear)) else m(x)\n"
        "def unused(m):\n"
        "    return type(m) is nn.Linear\n")
    paths = dict(forward_paths(tree))
    assert set(paths) == {"Block.forward", "Block._route", "pick"}
    assert [text for line, text in type_tests(paths["pick"], {"Block"})] == ["isinstance(m, (Block, nn.Linear))"]
    assert type_tests(tree.body[2], set()) == [(9, "type(m) is nn.Linear")]


# ------------------------------------------------------------------------------ layout protocol
def named_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Lines where one of `names` is an attribute (read or written) or a string constant (a name
    for getattr / hasattr / setattr, or a tuple of names looped over)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            out.append((node.lineno, repr(node.value)))
    return out


def test_layout_attribute_protocol_only_in_the_layout_modules():
    found = []
    for mod in in_dir("dsa_train/"):
        if mod.path not in LAYOUT_MODULES:
            found += [f"{mod.path}:{line} {text}" for line, text in named_uses(mod.tree, LAYOUT_PROTOCOL)]
    assert not found, ("sharding facts read or written outside parallel/{layout,sharding,deepspeed_compat}.py "
                       "(ask the layout / the parameter's Sharding record):\n" + "\n".join(found))


# ------------------------------------------------------------------------------ DeepSpeed's private names
def deepspeed_private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    out = named_uses(tree, DEEPSPEED_INTERNALS)
    bound = set()  # local names bound to deepspeed modules or objects imported from them
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    bound.add(alias.asname or "deepspeed")
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        out.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed" and not node.level:
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(part.startswith("_") for part in [*node.module.split("."), alias.name]):
                    out.append((node.lineno, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted(node).split(".")[0] in bound:
            attr = node.attr
            if attr.startswith("_") and not attr.startswith("__"):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_EXPERT_"):
            out.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.ClassDef) and any(dotted(b).split(".")[0] in bound for b in node.bases):
            out.append((node.lineno, f"class {node.name} derives from a DeepSpeed class"))
    return sorted(set(out))


def test_the_deepspeed_check_finds_private_names():
    tree = ast.parse(
        "from deepspeed.utils import groups as dsg\n"
        "import deepspeed\n"
        "from deepspeed.moe.layer import MoE\n"
        "dsg._EXPERT_PARALLEL_GROUP['x'] = 1\n"
        "getattr(dsg, '_EXPERT_DATA_PARALLEL_GROUP')\n"
        "engine.enable_backward_allreduce = False\n"
        "hasattr(opt, 'fp32_partitioned_groups_flat')\n"
        "class Marker(MoE):\n    pass\n"
        "deepspeed.initialize(model=m)\n"
        "opt._private_of_our_own()\n")  # not reached through a deepspeed name: not DeepSpeed's
    assert [line for line, _ in deepspeed_private_uses(tree)] == [4, 5, 6, 7, 8]


def test_deepspeed_private_names_only_in_the_adapter():
    found = []
    for mod in in_dir("dsa_train/"):
        if mod.path != DEEPSPEED_ADAPTER:
            found += [f"{mod.path}:{line} {text}" for line, text in deepspeed_private_uses(mod.tree)]
    assert not found, f"DeepSpeed's private names outside {DEEPSPEED_ADAPTER}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", sorted(LAYOUT_MODULES))
def test_the_named_layout_modules_exist(path):
    # the allowances above name files: a rename must move them, not silently widen the checks
    assert (ROOT / path).is_file(), f"{path} is named by tests/test_structure.py but does not exist"


# ------------------------------------------------------------------------------ the architecture doc's table
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
ROOT_PACKAGE_FILE = "__init__.py"  # the table's row for dsa_train's own __init__


def package_of(module: str) -> str:
    """The unit the table documents a module under: `dsa_kernels` for the kernels, `dsa_train`
    for dsa_train's own __init__, else dsa_train's subpackage or top-level module (model, loss)."""
    parts = module.split(".")
    if parts[0] != "dsa_train":
        return parts[0]
    return parts[1] if len(parts) > 1 else "dsa_train"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = package_of(module)
        out.setdefault(mine, set()).update(package_of(t) for t in targets)
    return {package: targets - {package} for package, targets in out.items()}


def doc_names(cell: str, packages: set[str]) -> set[str]:
    """The packages a table cell names: backticked `x/`, `x/...`, `x.py`, `x` (a package's name),
    `dsa_kernels/...` for dsa_kernels; other backticked names (classes, functions) are prose."""
    found = set()
    for token in cell.split("`")[1::2]:
        token = token.strip().removeprefix("dsa_train.").removeprefix("dsa_train/")
        if token == ROOT_PACKAGE_FILE:
            found.add("dsa_train")
            continue
        head = token.split("/")[0].split(".")[0] if "/" in token else token.removesuffix(".py").split(".")[0]
        if head in packages:
            found.add(head)
    return found


def package_table(text: str) -> list[tuple[str, str, str]]:
    """(package cell, imports cell, the row) of the `## Packages` table."""
    section = text.split("\n## Packages", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= {"-", " "} and cells[0] != "package":
            rows.append((cells[0], cells[2], line))
    return rows


def table_problems(text: str, graph: dict[str, set[str]]) -> list[str]:
    actual = package_graph(graph)
    packages = set(actual) | {t for ts in actual.values() for t in ts}
    problems, documented = [], {}
    for names_cell, imports_cell, line in package_table(text):
        names = doc_names(names_cell, packages)
        if not names:
            problems.append(f"row names no package of the code: {line[:80]}")
            continue
        for name in names:
            if name in documented:
                problems.append(f"{name}: in two rows")
            documented[name] = line
        listed = set() if imports_cell == "none" else doc_names(imports_cell, packages)
        imported = set().union(*(actual.get(n, set()) for n in names)) - names
        label = " + ".join(sorted(names))
        if imported - listed:
            problems.append(f"{label}: imports {', '.join(sorted(imported - listed))}, not in its row")
        if listed - imported:
            problems.append(f"{label}: its row lists {', '.join(sorted(listed - imported))}, which it does not import")
    problems += [f"{name}: no row" for name in sorted(set(actual) - set(documented))]
    return problems


def test_the_table_check_finds_what_the_doc_gets_wrong():
    graph = {"dsa_train": {"dsa_train.model"}, "dsa_train.model.a": {"dsa_kernels.ops", "dsa_train.loss"},
             "dsa_train.loss": set(), "dsa_kernels.ops": set(), "dsa_train.trainer.b": {"dsa_train.model.a"}}
    text = ("# Doc\n\n## Packages\n\n| package | what | imports (project) |\n|---|---|---|\n"
            "| `dsa_kernels/` | ops | none |\n"
            "| `model/` | `MoE` | `dsa_kernels`, `loss` (`micro_batch_loss`) |\n"
            "| `loss.py` | losses | `model/` |\n"
            "| `__init__.py` | lazy | `model/` |\n\n## Next\n")
    assert table_problems(text, graph) == ["loss: its row lists model, which it does not import", "trainer: no row"]


def test_the_architecture_docs_package_table_matches_the_imports():
    problems = table_problems(ARCHITECTURE_DOC.read_text(), import_graph(project_modules()))
    assert not problems, ("docs/architecture.md's package table (## Packages) disagrees with the code's imports "
                          "(fix the row, or the import):\n" + "\n".join(problems))


# ------------------------------------------------------------------------------ the fault seam
FAULT_SEAM = {"checkpoint_faults", "CheckpointFaults", "NO_FAULTS"}  # what the writer may take from faults.py


def fault_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Lines naming faults.py or one of its names other than the writer's seam."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("faults"):
            out += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name not in FAULT_SEAM]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[-1] == "faults"]
        elif isinstance(node, ast.Name) and node.id == "faults" or isinstance(node, ast.Attribute) and node.attr == "faults":
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_fault_injection_is_one_seam():
    modules = {m.path: m for m in project_modules().values()}
    found = []
    for path in ("dsa_train/trainer/trainer.py", "dsa_train/checkpoint/training.py"):
        found += [f"{path}:{line} {text}" for line, text in fault_uses(modules[path].tree)]
    assert not found, ("fault injection outside its seam (the trainer takes trainer/hooks.py's fault_hooks, the "
                       "checkpoint writer faults.checkpoint_faults):\n" + "\n".join(found))
    assert sorted(fault_uses(ast.parse("import dsa_train.faults as faults\nfaults.at('step', 1)\n"
                                       "from dsa_train.faults import checkpoint_faults, WriteFaults\n"))) == [
        (1, "import dsa_train.faults"), (2, "faults"), (3, "from dsa_train.faults import WriteFaults")]


# ------------------------------------------------------------------------------ light imports
# modules a light import must not load: the model, the kernels and the frameworks only they need
HEAVY_MODULES = ("dsa_train.model", "dsa_kernels", "triton", "dsa_train.checkpoint", "dsa_train.trainer")

LIGHT_IMPORT_PROBE = """
import contextlib, io, json, sys
heavy = HEAVY
def loaded():
    return sorted(m for m in sys.modules if m.startswith(heavy))
steps = {}
import dsa_train
steps["import dsa_train"] = loaded()
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = __import__("dsa_train.cli").cli.main(["--help"])
assert code == 0 and "subcommands:" in out.getvalue(), out.getvalue()[:200]
steps["dsa-train --help"] = loaded()
from dsa_train.config import DataConfig, validate
steps["from dsa_train.config import DataConfig, validate"] = loaded()
import dsa_train.data
steps["import dsa_train.data"] = loaded()
# the lazy re-exports resolve, and then the model is loaded: the check above can see it
steps["the public API resolves"] = [dsa_train.tiny_config(num_hidden_layers=1).num_hidden_layers,
                                    dsa_train.from_pretrained is sys.modules["dsa_train.checkpoint"].from_pretrained,
                                    "dsa_train.model" in sys.modules]
print(json.dumps(steps))
"""


@pytest.mark.integration
def test_light_commands_load_neither_the_model_nor_the_kernels():
    code = LIGHT_IMPORT_PROBE.replace("HEAVY", repr(HEAVY_MODULES))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    heavy = {step: modules for step, modules in steps.items() if step != "the public API resolves" and modules}
    assert not heavy, "a light import loaded the model or the kernels (import them where they are used):\n" + "\n".join(
        f"{step}: {', '.join(modules[:8])}" for step, modules in heavy.items())
    assert steps["the public API resolves"] == [1, True, True]


def test_the_lazy_reexports_give_every_public_name():
    for package in ("dsa_train", "dsa_train.config"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{package}.{name}"
            assert name in dir(module), f"{package}.{name} missing from dir()"
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            getattr(module, "no_such_name")
    from dsa_train.config import validate
    from dsa_train.config.validate import validate as the_function

    # `validate` is also a submodule's name: the package gives the function, whatever was imported first
    assert validate is the_function


# ------------------------------------------------------------------------------ package order
# The floors of the project, top first: a module may import (at module level, in a function or
# under TYPE_CHECKING alike) only from its own floor or the floors after it. A floor is a package
# of dsa_train (dsa_train/<name>/), a top-level module (dsa_train/<name>.py) or the kernels
# (dsa_kernels). The root package `dsa_train/__init__` is the facade (lazy re-exports) and on no
# floor. docs/architecture.md draws the same order.
PACKAGE_ORDER = [
    "launch",      # `dsa-train launch torchrun|slurm`, the per-rank entry
    "cli",         # `dsa-train`: Hydra training run, subcommand dispatch
    "testing",     # product checks outside the unit tests (selftest, memcheck)
    "gpucheck",    # `dsa-train gpu-check`
    "plan",        # `dsa-train plan`: memory / step-time estimate, the fake-rank trace
    "trainer",     # Trainer, engines, one optimizer step, checkpoint manager, start-up
    "logging",     # metrics, W&B, progress, report
    "eval",        # `dsa-train eval` and the in-training evaluation
    "parallel",    # layout, groups, parallelize_model, collectives, DeepSpeed adapter
    "training_engine",  # the engine Protocol (the layout annotates with it)
    "checkpoint",  # every checkpoint format: Hugging Face, export, training checkpoints
    "data",        # sources, tokenizer, packing, loaders
    "config",      # structured configs, recipes, validation
    "stage",       # what a stage trains
    "model",       # the plain model
    "loss",        # the LM and indexer losses
    "dsa_kernels", # Triton / Gluon kernels and their references
    "faults", "signals", "sharding", "runtime", "tempdirs", "lazy", "errors", "version",  # the ground floor
]


def floor_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "dsa_kernels":
        return "dsa_kernels"
    return parts[1] if len(parts) > 1 else None  # the root package: the facade


def upward_imports(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(order)}
    bad = []
    for module, targets in sorted(graph.items()):
        low = floor_of(module)
        for target in sorted(targets):
            high = floor_of(target)
            if low is None or high is None or low == high:
                continue
            if rank[high] < rank[low]:
                bad.append(f"{module} ({low}) imports {target} ({high}), a floor above it")
    return bad


def test_every_module_has_a_floor():
    floors = {floor_of(m) for m in project_modules()} - {None}
    assert floors <= set(PACKAGE_ORDER), (
        f"not on a floor: {sorted(floors - set(PACKAGE_ORDER))} (add it to PACKAGE_ORDER in tests/test_structure.py)")
    assert floors == set(PACKAGE_ORDER), f"floors without code: {sorted(set(PACKAGE_ORDER) - floors)}"


def test_imports_run_down_the_floors():
    bad = upward_imports(import_graph(project_modules()), PACKAGE_ORDER)
    assert not bad, "imports up the package order:\n" + "\n".join(bad)


def test_the_order_check_sees_a_function_level_import_upward():
    modules = load_modules({
        "dsa_train": ("dsa_train/__init__.py", "", True),
        "dsa_train.model": ("dsa_train/model/__init__.py", "", True),
        "dsa_train.model.mla": ("dsa_train/model/mla.py", "def f():\n    from dsa_train.trainer.step import x\n", False),
        "dsa_train.trainer": ("dsa_train/trainer/__init__.py", "", True),
        "dsa_train.trainer.step": ("dsa_train/trainer/step.py", "from dsa_train.model.mla import f\nx = 1\n", False),
    })
    bad = upward_imports(import_graph(modules), ["trainer", "model"])
    assert bad == ["dsa_train.model.mla (model) imports dsa_train.trainer (trainer), a floor above it",
                   "dsa_train.model.mla (model) imports dsa_train.trainer.step (trainer), a floor above it"]


def test_every_package_says_what_it_holds():
    missing = [m.path for m in project_modules().values()
               if m.is_package and m.name.startswith("dsa_train") and len(ast.get_docstring(m.tree) or "") < 40]
    assert not missing, f"packages without a docstring saying what they hold: {missing}"

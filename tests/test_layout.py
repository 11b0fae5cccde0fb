"""The package's shape: runtime apart from tooling, no import cycles, no oversized modules.

Runtime is every module at the top of ``dspark_hf/`` (the decoding path); tooling is the
``training``, ``benchmarks`` and ``hub`` subpackages. Imports are read with ``ast`` from the
source, including imports inside functions; imports under ``if TYPE_CHECKING:`` are for
annotations only and never run, so they are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "dspark_hf"
TOOLING_PACKAGES = ("dspark_hf.training", "dspark_hf.benchmarks", "dspark_hf.hub")
MAX_LINES = 600

# Runtime -> tooling imports that are deliberate entry points for users, with the reason.
ALLOWED_TOOLING_IMPORTS = {
    ("dspark_hf", "dspark_hf.hub"): "the package facade re-exports export, push_to_hub and render_model_card",
    ("dspark_hf.modeling_dspark", "dspark_hf.hub.draft_export"):
        "DSparkDraftModel.push_to_hub (transformers' method on the model) delegates to the Hub exporter",
}
# Top-level modules that are command-line entry points rather than the decoding path.
ENTRY_POINTS = {"dspark_hf.cli": "the dspark-hf command dispatches to the tooling CLIs by module name"}


# ----------------------------------------------------------------------------- reading the tree
def _is_package_dir(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def _modules() -> dict[str, Path]:
    """Importable modules of the package: ``.py`` files whose folders are all packages
    (template folders such as ``hub/templates`` hold files that are copied, not imported)."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        folders = path.relative_to(PACKAGE_DIR.parent).parent.parts
        if not all(_is_package_dir(PACKAGE_DIR.parent.joinpath(*folders[: i + 1])) for i in range(len(folders))):
            continue
        parts = list(folders) + ([] if path.stem == "__init__" else [path.stem])
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _resolve(name: str) -> str | None:
    """The package module a dotted name refers to (the longest importable prefix), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _imports_of(module: str) -> set[str]:
    """Package modules ``module`` imports explicitly (function-level imports included)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # "from pkg import name" imports the submodule pkg.name when there is one
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in names:
            if name == "dspark_hf" or name.startswith("dspark_hf."):
                resolved = _resolve(name)
                if resolved is not None and resolved != module:
                    targets.add(resolved)
    return targets


def _named_in_strings(module: str) -> set[str]:
    """Tooling modules a module names in a string constant (``importlib.import_module("...")``)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    pattern = re.compile(r"^(%s)(\.\w+)*$" % "|".join(re.escape(p) for p in TOOLING_PACKAGES))
    return {_resolve(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value)
            and _resolve(node.value)}


GRAPH = {module: _imports_of(module) for module in MODULES}


def _is_tooling(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in TOOLING_PACKAGES)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats: that closes a cycle
            succ = min(s for s in graph[path[-1]] if s in component)
            if succ in seen:
                cycles.append(path[path.index(succ):] + [succ])
                break
            path.append(succ)
            seen.add(succ)
    return cycles


# ------------------------------------------------------------------------------------- the tests
def test_the_graph_sees_the_package():
    assert {"dspark_hf", "dspark_hf.modeling_dspark", "dspark_hf.training.trainer", "dspark_hf.benchmarks.bench_cli",
            "dspark_hf.hub.draft_export"} <= set(MODULES)
    assert not any(".templates" in m for m in MODULES)  # copied files, not modules
    assert "dspark_hf.configuration_dspark" in GRAPH["dspark_hf.modeling_dspark"]
    # function-level imports count; TYPE_CHECKING imports do not
    assert "dspark_hf.hub.draft_export" in GRAPH["dspark_hf.modeling_dspark"]
    assert "dspark_hf.modeling_dspark" not in GRAPH["dspark_hf.hub.draft_export"]


def test_no_import_cycles():
    found = list(_cycles(GRAPH))
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" -> ".join(c) for c in found)


def test_runtime_never_imports_tooling():
    offenders = []
    for module, targets in sorted(GRAPH.items()):
        if _is_tooling(module) or module in ENTRY_POINTS:
            continue
        for target in sorted(targets | _named_in_strings(module)):
            if _is_tooling(target) and not any(
                    module == m and (target == t or target.startswith(t + ".")) for m, t in ALLOWED_TOOLING_IMPORTS):
                offenders.append(f"{module} imports {target}")
    assert not offenders, "runtime modules importing tooling:\n" + "\n".join(offenders)


def test_allowed_crossings_are_still_needed():
    """An exception that no longer happens should be deleted, not kept as a loophole."""
    for module, target in ALLOWED_TOOLING_IMPORTS:
        assert any(t == target or t.startswith(target + ".") for t in GRAPH[module]), (module, target)


def test_no_module_over_the_line_limit():
    too_long = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in MODULES.items()}
    too_long = {m: n for m, n in too_long.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: " + ", ".join(f"{m} ({n})" for m, n in sorted(too_long.items()))

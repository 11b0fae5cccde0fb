"""The package's shape: runtime apart from tooling, the CPU engine apart from the core, no import cycles,
no oversized modules, and names imported from where they live rather than from compatibility shims.

Runtime is the decoding path: the ``model``, ``decoding`` and ``scheduling`` subpackages and the few
modules at the top of ``dspark_hf/``; tooling is the ``training``, ``benchmarks`` and ``hub`` subpackages.
The core (those six subpackages) imports nothing of the CPU engine (``dspark_cpu``, in ``cpu_engine/``): only
the seam module ``dspark_hf.cpu_engine`` names it, in a string for importlib. The engine imports only
dspark_hf's small shared helpers (``ENGINE_MAY_IMPORT``). Imports are read with ``ast`` from the
source, including imports inside functions; imports under ``if TYPE_CHECKING:`` are for
annotations only and never run, and those under ``if __name__ == "__main__":`` run only when the
file is the program (as the module ``__main__``, never when it is imported), so both are left out of the
runtime/tooling rules; cycles count ``__main__`` imports too (``python -m`` of one module must not need
another that imports it back).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "dspark_hf"
ENGINE = "dspark_cpu"
ENGINE_DIR = PACKAGE_DIR.parent / "cpu_engine" / ENGINE  # absent where the engine is not part of the checkout
TOOLING_PACKAGES = ("dspark_hf.training", "dspark_hf.benchmarks", "dspark_hf.hub")
MAX_LINES = 600

# Runtime -> tooling imports that are deliberate entry points for users, with the reason.
ALLOWED_TOOLING_IMPORTS = {
    ("dspark_hf", "dspark_hf.hub"): "the package facade re-exports export, push_to_hub and render_model_card",
}
# Top-level modules that are command-line entry points rather than the decoding path.
ENTRY_POINTS = {"dspark_hf.cli": "the dspark-hf command dispatches to the tooling CLIs by module name"}
# Top-level modules that tools, examples and users share but the decoding path never imports.
HELPERS = {
    "dspark_hf.demo_target": "SmolLM2-135M-Instruct, the demo target of the README, examples, bench and train",
    "dspark_hf.chat_text": "prompt ids with the chat template and EOS trimming, for the benchmarks and training data",
}
# Compatibility shims: they re-export names that live elsewhere now; package code imports the new homes.
SHIMS = {
    "dspark_hf.scheduler": "policies, drafting gate, step rates, cost model and cache dir moved out of it",
    "dspark_hf.training.smollm2": "the demo target moved to dspark_hf.demo_target",
    "dspark_hf.modeling_dspark": "public path of dspark_hf.model.modeling_dspark (Hub remote code imports it)",
    "dspark_hf.configuration_dspark": "public path of dspark_hf.model.configuration_dspark (Hub remote code)",
    "dspark_hf.custom_generate": "public path of dspark_hf.decoding.custom_generate (Hub custom_generate files)",
    "dspark_hf.benchmarks.evaluation": "`python -m dspark_hf.benchmarks.evaluation`; its library is benchmarks.acceptance",
}
# Where runtime modules live: one subpackage per idea; only these stay at the top of the package.
RUNTIME_GROUPS = ("dspark_hf.model", "dspark_hf.decoding", "dspark_hf.scheduling")
# The DSpark core: it imports nothing of the CPU engine.
CORE_PACKAGES = RUNTIME_GROUPS + TOOLING_PACKAGES
# Small top-level helpers that the core and the CPU engine share; they import neither.
CORE_ENGINE_HELPERS = {
    "dspark_hf.cache_dir": "where built files and caches go",
    "dspark_hf.build_tools": "the C++ toolchain check before a build (CUDA op, CPU extension)",
    "dspark_hf.kv_buffers": "fixed-stride KV buffers (the draft's context cache, the engine's lean decoder)",
    "dspark_hf.machine": "the CPU's model and vector extensions, Linux's huge page mode",
    "dspark_hf.engine_hooks": "the seams an engine plugs into: the packing hook, the backend fingerprint",
}
# What an engine module may import of dspark_hf: the shared helpers only (not the facade, not the core).
ENGINE_MAY_IMPORT = set(CORE_ENGINE_HELPERS)
# The one module that names the engine, in a string for importlib (the engine-loading seam).
ENGINE_SEAM = "dspark_hf.cpu_engine"
TOP_LEVEL = {"dspark_hf", "dspark_hf.cli", "dspark_hf.demo_target", "dspark_hf.chat_text", ENGINE_SEAM,
             *CORE_ENGINE_HELPERS}
# Names a runtime module still re-exports for old code: imported from their home everywhere else.
MOVED_NAMES = {("dspark_hf.decoding.candidate_generator", "RoundStats"): "dspark_hf.decoding.rounds",
               ("dspark_hf.decoding.candidate_generator", "DSparkGenerationStats"): "dspark_hf.decoding.rounds",
               ("dspark_hf.decoding.settings", "DraftRuntimeSettings"): "dspark_hf.model.draft_runtime",
               ("dspark_hf.decoding.settings", "record_generation_stats"): "dspark_hf.model.draft_runtime",
               **{("dspark_hf.training.data", name): "dspark_hf.chat_text"
                  for name in ("chat_prompt_ids", "encode_prompt", "has_chat_template", "trim_after_eos")},
               **{("dspark_hf.benchmarks.evaluation", name): "dspark_hf.benchmarks.acceptance"
                  for name in ("left_padded", "measure_acceptance", "tau_table")}}
REPO = PACKAGE_DIR.parent
# The scheduling stack: how much is drafted and verified, and the round around it. The model sits
# below it (its run-time state lives in dspark_hf.model.draft_runtime), so loading a draft loads none of it.
SCHEDULING_STACK = ("dspark_hf.decoding.settings", "dspark_hf.scheduling.policies", "dspark_hf.scheduling.step_rates",
                    "dspark_hf.scheduling.shared_cost", "dspark_hf.scheduling.cost_model",
                    "dspark_hf.scheduling.drafting_gate", "dspark_hf.decoding.context_lookup", "dspark_hf.decoding.rounds")


# ----------------------------------------------------------------------------- reading the tree
def _is_package_dir(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def _modules() -> dict[str, Path]:
    """Importable modules of the package and of the CPU engine (where its folder is there): ``.py`` files whose
    folders are all packages (template folders such as ``hub/templates`` hold files that are copied, not imported)."""
    found = {}
    for package_dir in (PACKAGE_DIR, ENGINE_DIR):
        for path in sorted(package_dir.rglob("*.py")) if package_dir.is_dir() else []:
            folders = path.relative_to(package_dir.parent).parent.parts
            if not all(_is_package_dir(package_dir.parent.joinpath(*folders[: i + 1])) for i in range(len(folders))):
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


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _import_nodes(tree: ast.AST, *, skip_main_guard: bool = True):
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:`` and (unless
    ``skip_main_guard`` is False) ``if __name__ == "__main__":``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child) or (skip_main_guard and _is_main_guard(child)):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _imported_names(path: Path, package: str | None) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from module import name`` in ``path`` and ``(module, "")`` for
    every ``import module``, at any depth (``__main__`` guards included). Relative imports are
    resolved against ``package`` (None outside the package, where imports are absolute)."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in _import_nodes(tree, skip_main_guard=False):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
            continue
        if node.level and package is not None:
            base_parts = package.split(".")
            base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        found += [(module, alias.name) for alias in node.names]
    return found


def _resolve(name: str) -> str | None:
    """The package module a dotted name refers to (the longest importable prefix), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _imports_of(module: str, *, skip_main_guard: bool = True) -> set[str]:
    """Package and engine modules ``module`` imports explicitly (function-level imports included; those under
    ``if __name__ == "__main__":`` too when ``skip_main_guard`` is False)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(tree, skip_main_guard=skip_main_guard):
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
            if any(name == root or name.startswith(root + ".") for root in ("dspark_hf", ENGINE)):
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
# With the imports under __main__ guards: what `python -m <module>` imports. Cycles are looked for here.
PROGRAM_GRAPH = {module: _imports_of(module, skip_main_guard=False) for module in MODULES}


def _is_tooling(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in TOOLING_PACKAGES)


def _is_engine(module: str) -> bool:
    return module == ENGINE or module.startswith(ENGINE + ".")


def _is_core(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CORE_PACKAGES)


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
    assert {"dspark_hf", "dspark_hf.model.modeling_dspark", "dspark_hf.training.trainer", "dspark_hf.benchmarks.bench_cli",
            "dspark_hf.hub.draft_export"} <= set(MODULES)
    assert not any(".templates" in m for m in MODULES)  # copied files, not modules
    assert "dspark_hf.model.configuration_dspark" in GRAPH["dspark_hf.model.modeling_dspark"]
    # function-level imports count; TYPE_CHECKING imports do not
    assert "dspark_hf.training.target_loading" in GRAPH["dspark_hf.benchmarks.evaluate_cli"]
    assert "dspark_hf.model.modeling_dspark" not in GRAPH["dspark_hf.hub.draft_export"]
    # the import under evaluation.py's __main__ guard (`python -m dspark_hf.benchmarks.evaluation`) counts for
    # cycles only; both it and the command import the library, which imports neither
    assert "dspark_hf.benchmarks.evaluate_cli" not in GRAPH["dspark_hf.benchmarks.evaluation"]
    assert "dspark_hf.benchmarks.evaluate_cli" in PROGRAM_GRAPH["dspark_hf.benchmarks.evaluation"]
    assert "dspark_hf.benchmarks.acceptance" in GRAPH["dspark_hf.benchmarks.evaluate_cli"]
    assert not {"dspark_hf.benchmarks.evaluation", "dspark_hf.benchmarks.evaluate_cli"} & PROGRAM_GRAPH[
        "dspark_hf.benchmarks.acceptance"]


def test_no_import_cycles():
    found = list(_cycles(PROGRAM_GRAPH))
    assert not found, ("import cycles (imports inside functions and under __main__ guards count):\n"
                       + "\n".join(" -> ".join(c) for c in found))


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


def test_the_decoding_path_never_imports_the_shared_helpers():
    """The demo target and the chat helpers sit at the top of the package for tools and examples;
    generation must not depend on them (nor load a demo model)."""
    offenders = [f"{module} imports {target}" for module, targets in sorted(GRAPH.items())
                 if not _is_tooling(module) and module not in ENTRY_POINTS and module not in HELPERS
                 for target in sorted(targets) if target in HELPERS]
    assert not offenders, "decoding-path modules importing the shared helpers:\n" + "\n".join(offenders)


def _reachable(module: str) -> set[str]:
    """Every package module ``module`` imports, directly or through others."""
    seen, stack = set(), [module]
    while stack:
        for target in GRAPH[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def test_the_model_sits_below_the_scheduling_stack():
    """``modeling_dspark`` imports nothing from the scheduling stack, directly or through another
    module: the draft's run-time state (statistics, deprecated attributes) is ``draft_runtime``'s."""
    assert all(module in MODULES for module in SCHEDULING_STACK)
    reached = sorted(_reachable("dspark_hf.model.modeling_dspark") & set(SCHEDULING_STACK))
    assert not reached, f"dspark_hf.model.modeling_dspark reaches the scheduling stack: {reached}"


def test_no_package_module_imports_a_compatibility_shim():
    """Shims exist for code outside the package; inside it, each name comes from its home."""
    offenders = [f"{module} imports {target}" for module, targets in sorted(GRAPH.items())
                 for target in sorted(targets) if target in SHIMS and module not in SHIMS]
    assert not offenders, "package modules importing a compatibility shim:\n" + "\n".join(offenders)


def _python_files() -> list[tuple[str, Path, str | None]]:
    """``(name, path, package)`` of the package's modules and of the Python files of ``tests/``,
    ``benchmarks/``, ``examples/`` and ``model_cards/`` (package None: absolute imports only)."""
    inside = [(module, path, module if path.stem == "__init__" else module.rpartition(".")[0])
              for module, path in sorted(MODULES.items())]
    outside = [(str(path.relative_to(REPO)), path, None)
               for folder in ("tests", "benchmarks", "examples", "model_cards", "cpu_engine/tests")
               if (REPO / folder).is_dir()
               for path in sorted((REPO / folder).rglob("*.py"))
               if path.name != "test_moved_names.py"]  # that test checks the former homes still answer
    return inside + outside


def test_moved_names_are_imported_from_their_home():
    """The statistics classes come from ``dspark_hf.decoding.rounds``, the chat helpers from
    ``dspark_hf.chat_text`` and the demo target from ``dspark_hf.demo_target``, in the package and in
    the tests, scripts and examples alike: the former homes re-export them only for code written
    against earlier versions."""
    offenders = []
    for name, path, package in _python_files():
        for source, imported in _imported_names(path, package):
            if (source, imported) in MOVED_NAMES and name != source:
                offenders.append(f"{name}: from {source} import {imported} (use {MOVED_NAMES[source, imported]})")
            elif (source == "dspark_hf.training.smollm2" or (source, imported) == ("dspark_hf.training", "smollm2")) \
                    and name not in SHIMS:
                offenders.append(f"{name}: imports dspark_hf.training.smollm2 (use dspark_hf.demo_target)")
    assert not offenders, "names imported from their former home:\n" + "\n".join(offenders)


def test_runtime_is_grouped_by_idea():
    """Every package module is tooling, in one of the runtime subpackages, a shim, or one of the few
    top-level modules (facade, CLI, cache folder, shared helpers): a new runtime module goes into the
    subpackage of its idea, not next to the facade."""
    stray = [m for m in MODULES if not _is_tooling(m) and m not in SHIMS and m not in TOP_LEVEL and not _is_engine(m)
             and not any(m == g or m.startswith(g + ".") for g in RUNTIME_GROUPS)]
    assert not stray, f"modules outside {RUNTIME_GROUPS}: {stray}"


# ------------------------------------------------------------------------- the core and the CPU engine
def _package_modules() -> dict[str, Path]:
    """dspark_hf's modules, read from its folder alone (whether or not the engine is there)."""
    return {m: p for m, p in MODULES.items() if not _is_engine(m)}


def test_the_core_imports_nothing_of_the_engine():
    """No module of dspark_hf imports dspark_cpu, at any depth (inside functions and ``__main__`` guards, and
    under ``if TYPE_CHECKING:``), and none names it in a string but the seam, which loads it with importlib."""
    offenders = []
    for module, path in sorted(_package_modules().items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module for node in ast.walk(tree)  # relative imports stay inside dspark_hf
                     if isinstance(node, ast.ImportFrom) and not node.level and node.module]
        offenders += [f"{module} imports {name}" for name in sorted(set(imported))
                      if name == ENGINE or name.startswith(ENGINE + ".")]
        named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and re.fullmatch(rf"{ENGINE}(\.\w+)*", node.value)}
        if named and module != ENGINE_SEAM:
            offenders.append(f"{module} names {sorted(named)} (only {ENGINE_SEAM} loads the engine)")
    assert not offenders, "the core reaching into the CPU engine:\n" + "\n".join(offenders)
    import dspark_hf.cpu_engine

    assert dspark_hf.cpu_engine.ENGINE_MODULE == ENGINE
    assert "importlib" in {name for name, _ in _imported_names(MODULES[ENGINE_SEAM], "dspark_hf")}


def test_the_engine_imports_only_the_shared_helpers():
    """dspark_cpu imports, of dspark_hf, only the small helpers both share: not the facade, not the core
    (model, decoding, scheduling, training, hub, benchmarks); and those helpers import neither."""
    if not ENGINE_DIR.is_dir():
        pytest.skip(f"the CPU engine is not in this checkout ({ENGINE_DIR} is absent)")
    engine = {m: p for m, p in MODULES.items() if _is_engine(m)}
    assert {"dspark_cpu", "dspark_cpu.fast_path", "dspark_cpu.kernel_choices"} <= set(engine)
    offenders = []
    for module, path in sorted(engine.items()):
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        for source, name in _imported_names(path, package):
            target = source if source != "dspark_hf" or not name else f"{source}.{name}"
            if (target == "dspark_hf" or target.startswith("dspark_hf.")) and target not in ENGINE_MAY_IMPORT:
                offenders.append(f"{module} imports {target}")
    for helper in CORE_ENGINE_HELPERS:
        offenders += [f"{helper} (a shared helper) imports {t}" for t in sorted(GRAPH[helper])
                      if _is_core(t) or _is_engine(t) or t == "dspark_hf"]
    assert not offenders, "engine modules reaching past the shared helpers:\n" + "\n".join(offenders)


def test_the_old_kernels_package_is_gone():
    """``dspark_hf.kernels`` became the CPU engine (``dspark_cpu``) and ``dspark_hf.decoding.cuda_ops``."""
    assert not list((PACKAGE_DIR / "kernels").rglob("*.py")) and not (PACKAGE_DIR / "kernels" / "csrc").exists()
    offenders = [name for name, path, package in _python_files()
                 if any(source == "dspark_hf.kernels" or source.startswith("dspark_hf.kernels.")
                        for source, _ in _imported_names(path, package))]
    assert not offenders, f"imports of dspark_hf.kernels: {offenders}"

"""Imports inside sparseserve/ run one way, down the layer table of docs/architecture.md.

Every module's imports are read with `ast` (top-level, function-level and relative imports;
only `if TYPE_CHECKING:` blocks, which never run, are skipped). A module may import its own
layer or any layer below it, and the neutral modules from anywhere; nothing else. The layer
graph must also be free of cycles, and so must the module graph."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sparseserve"

# Top to bottom. A module belongs to the first entry that is its name or a prefix of it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entrypoints", ("sparseserve.entrypoints",)),
    ("benchmarks", ("sparseserve.benchmarks",)),
    ("api", ("sparseserve", "sparseserve.llm", "sparseserve.engine_args", "sparseserve.beam_search")),
    ("engine", ("sparseserve.engine",)),
    ("executor", ("sparseserve.executor",)),
    ("worker", ("sparseserve.worker",)),
    ("spec_decode", ("sparseserve.spec_decode",)),
    ("sample", ("sparseserve.sample", "sparseserve.structured_output")),
    ("model", ("sparseserve.model",)),
    ("distributed", ("sparseserve.distributed",)),
    ("kernels", ("sparseserve.kernels",)),
]
# Importable from every layer; they import only each other (and outside libraries). The public
# face's data types (SamplingParams in, RequestOutput out) are among them: the engine takes and
# returns them.
NEUTRAL = ("sparseserve.config", "sparseserve.envs", "sparseserve.logger", "sparseserve.step_types",
           "sparseserve.outputs", "sparseserve.sampling_params", "sparseserve.errors", "sparseserve.validation",
           "sparseserve.config_checks", "sparseserve.checkpoint_checks", "sparseserve.names",
           "sparseserve.quant_formats", "sparseserve.kv_format")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """Every node, except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(path: Path, known: set[str], root: Path = PACKAGE) -> set[str]:
    """The sparseserve modules `path` imports (for `from x import y`: x.y when that is a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in `target` itself
                found.add(target)
    return {m for m in found if m == "sparseserve" or m.startswith("sparseserve.")} - {name}


def layer_of(module: str) -> str | None:
    if any(module == n or module.startswith(n + ".") for n in NEUTRAL):
        return None
    best, best_len = None, -1
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, known) & known for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if m != "sparseserve" and layer_of(m) is None
               and not any(m == n or m.startswith(n + ".") for n in NEUTRAL)]
    assert not missing, f"modules outside the layer table (add them to LAYERS or NEUTRAL): {missing}"


def test_no_upward_imports():
    rank = {layer: i for i, (layer, _) in enumerate(LAYERS)}
    bad = []
    for module, targets in import_graph().items():
        src = layer_of(module)
        for target in targets:
            dst = layer_of(target)
            if src is None:  # a neutral module imports only neutral modules
                if dst is not None:
                    bad.append(f"{module} (neutral) -> {target} ({dst})")
            elif dst is not None and rank[dst] < rank[src]:
                bad.append(f"{module} ({src}) -> {target} ({dst})")
    assert not bad, "imports that run up the layer table:\n" + "\n".join(sorted(bad))


def test_no_cycles_between_layers():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        src = layer_of(module)
        for target in targets:
            dst = layer_of(target)
            if src and dst and src != dst:
                graph.setdefault(src, set()).add(dst)
    assert find_cycle(graph) is None, f"layer cycle: {' -> '.join(find_cycle(graph))}"


def test_no_cycles_between_modules():
    graph = import_graph()
    # A package's __init__ running on import of its submodules is not an import edge.
    cycle = find_cycle({m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()})
    assert cycle is None, f"module cycle: {' -> '.join(cycle)}"


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "sparseserve"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..engine import hidden\n"
        "from .. import envs\n"
        "def f():\n    from ..worker import runner\n    from . import b\n")
    (pkg / "model" / "b.py").write_text("")
    known = {"sparseserve", "sparseserve.envs", "sparseserve.worker", "sparseserve.worker.runner",
             "sparseserve.model.b"}
    found = imports_of(pkg / "model" / "a.py", known, root=pkg)
    assert found == {"sparseserve.envs", "sparseserve.worker.runner", "sparseserve.model.b"}
    assert not any("engine" in m for m in found)
    assert layer_of("sparseserve.worker.runner") == "worker" and layer_of("sparseserve.step_types") is None

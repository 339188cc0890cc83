"""Layers go one way: ``kernels`` and ``sim`` at the bottom, then ``policies`` and ``model``, then ``calibrate``
and ``runner``, then ``viz`` and ``benchmarks`` on top; no two modules import each other, through any path. Every
import counts, also one inside a function. The project imports itself as ``sparsebalance.<package>`` only."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "sparsebalance."
LAYER = {"kernels": 0, "sim": 0, "policies": 1, "model": 1, "calibrate": 2, "runner": 2, "viz": 3, "benchmarks": 3}
# Inside a package, module pairs that must not depend on each other in this direction.
FORBIDDEN_MODULES = [("sim.cost", "sim.run")]


def raw_imports(path: Path) -> set[str]:
    """Module names a file imports, anywhere in it, as written (relative imports with their dots)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = "." * node.level + node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update("." * node.level + alias.name for alias in node.names)
    return names


def imports_of(path: Path) -> set[str]:
    """The project's module names a file imports, absolute and without the namespace prefix."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    names = set()
    for name in raw_imports(path):
        if name.startswith("."):
            dots = len(name) - len(name.lstrip("."))
            base = package.split(".")[: len(package.split(".")) - dots + 1]
            name = ".".join([*base, name.lstrip(".")])
        names.add(name.removeprefix(NAMESPACE))
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the modules that import across."""
    edges = defaultdict(list)
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imports_of(path):
                target = name.split(".")[0]
                if target in LAYER and target != package:
                    edges[(package, target)].append(f"{module_name(path)} -> {name}")
    return edges


def test_the_scan_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\ndef f():\n    from sparsebalance.sim.run import fail\n"
                      "    import sparsebalance.runner.train as train\n")
    assert {"sim.run", "sim.run.fail", "runner.train"} <= raw_imports_stripped(source)


def raw_imports_stripped(path: Path) -> set[str]:
    return {name.removeprefix(NAMESPACE) for name in raw_imports(path)}


def project_files():
    return [path for package in LAYER for path in sorted((ROOT / package).rglob("*.py"))]


def test_the_project_imports_itself_through_the_namespace_only():
    """A bare ``import sim`` works in a checkout but not where the project is installed."""
    bare = [f"{path.relative_to(ROOT)}: {name}" for path in project_files() for name in raw_imports(path)
            if name.split(".")[0] in LAYER and name.split(".")[0] != "benchmarks"]
    assert not bare, "imports outside the sparsebalance namespace:\n" + "\n".join(bare)


def module_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name imported from a package counts as the package)."""
    modules = {module_name(path): path for path in project_files()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_the_module_scan_sees_a_circle():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert circles_of(graph) == [["a.x", "a.y", "a.z"]]


def circles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_no_import_circle_between_modules():
    graph = module_graph()
    assert not circles_of(graph), f"modules on an import circle: {circles_of(graph)}"


def test_no_package_imports_one_above_it_or_beside_it_in_the_two_lowest_layers():
    """``policies`` and ``model`` build on ``kernels`` and ``sim`` only; ``calibrate`` may use ``runner``'s
    attention."""
    bad = [
        via for (src, dst), vias in package_edges().items() for via in vias
        if LAYER[dst] > LAYER[src] or (LAYER[dst] == LAYER[src] <= 1)
    ]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_circle_between_packages():
    graph = defaultdict(set)
    for src, dst in package_edges():
        graph[src].add(dst)

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    circles = sorted(p for p in LAYER if reaches(p, p))
    assert not circles, f"packages on an import circle: {circles} ({dict(graph)})"


@pytest.mark.parametrize("importer,imported", FORBIDDEN_MODULES)
def test_forbidden_module_imports(importer, imported):
    path = ROOT / (importer.replace(".", "/") + ".py")
    assert not any(n == imported or n.startswith(imported + ".") for n in imports_of(path))

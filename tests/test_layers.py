"""Layers go one way: ``kernels`` and ``sim`` at the bottom, then ``policies``, then ``calibrate`` and
``runner``, then ``viz`` and ``benchmarks`` on top. Every import counts, also one inside a function."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"kernels": 0, "sim": 0, "policies": 1, "calibrate": 2, "runner": 2, "viz": 3, "benchmarks": 3}
# Inside a package, module pairs that must not depend on each other in this direction.
FORBIDDEN_MODULES = [("sim.cost", "sim.run")]


def imports_of(path: Path) -> set[str]:
    """Absolute module names a file imports, anywhere in it (relative imports stay inside their package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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
    source.write_text("import os\ndef f():\n    from sim.run import fail\n    import runner.train\n")
    assert {"sim.run", "sim.run.fail", "runner.train"} <= imports_of(source)


def test_no_package_imports_one_above_it_or_beside_it_at_the_bottom():
    bad = [
        via for (src, dst), vias in package_edges().items() for via in vias
        if LAYER[dst] > LAYER[src] or (LAYER[dst] == LAYER[src] == 0)
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

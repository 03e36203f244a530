"""The package's shape: one version, small modules, no import cycle, light imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import actviz

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_actviz_version_py() -> None:
    # Expand pyproject.toml as pip does when it builds the package (attr: is read statically).
    code = (
        "from setuptools.config.pyprojecttoml import read_configuration; "
        "print(read_configuration('pyproject.toml', expand=True)['project']['version'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == actviz.__version__
    from actviz._version import __version__

    assert __version__ == actviz.__version__ and __version__.count(".") == 2


PACKAGE = ROOT / "actviz"
MAX_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the actviz modules it imports, anywhere in the file (functions and TYPE_CHECKING too)."""
    import ast

    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:  # `from .pkg import module` names a module, else an attribute
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def test_no_module_is_over_300_lines() -> None:
    sizes = {_module_name(path): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 20 and "actviz.report.html" in sizes
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}


def test_no_import_cycle_inside_actviz() -> None:
    graph = _import_graph()
    assert "actviz.report.results" in graph["actviz.report.html"]  # the graph sees relative imports
    assert "actviz.layer_outputs" in graph["actviz.report.capture"]
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])

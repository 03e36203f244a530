"""The package's shape: one version, small modules, no import cycle, light imports, side effects where the
docs name them, project URLs into this repository and a changelog for this version."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
MAX_LINES = 400  # one idea a module (STYLE.md: under about 400 lines); split by idea, never to fit


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the actviz modules it imports, anywhere in the file (functions and TYPE_CHECKING too)."""
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


def test_no_module_is_over_400_lines() -> None:
    sizes = {_module_name(path): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 20 and "actviz.report.html" in sizes
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}


def _stage(module: str) -> str:
    """The sub-package a module belongs to (``capture`` of ``actviz.capture.root_hook``), or the module at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() and len(parts) == 2 else module


def test_sub_packages_import_one_way_and_common_imports_no_other_stage() -> None:
    edges: dict[str, set[str]] = {}
    for module, targets in _import_graph().items():
        edges.setdefault(_stage(module), set()).update(_stage(target) for target in targets if _stage(target) != _stage(module))
    assert {"summaries", "output", "common"} <= edges["capture"]  # the graph sees the sub-packages
    two_way = sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, set()))
    assert two_way == [], "sub-packages that import each other"
    assert edges["common"] == set(), "actviz.common imports only itself: it is the leaves every stage may import"
    for leaf in ("actviz.options", "actviz.schedule", "actviz.selection", "actviz.tags"):
        assert edges.get(leaf, set()) <= {"common"}, f"{leaf} sits at the top for every stage to read"


def _tree_files() -> set[str]:
    """The files of the tree in docs/how-it-works.md's "Where the code is": ``capture/root_hook.py``, ..."""
    text = (ROOT / "docs" / "how-it-works.md").read_text().split("## Where the code is", 1)[1]
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    folders: list[tuple[int, str]] = []
    files = set()
    for line in block.splitlines()[1:]:  # the first line is actviz/ itself
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        folders = [(depth, folder) for depth, folder in folders if depth < indent]
        path = "".join(folder for _, folder in folders) + name
        if name.endswith("/"):
            folders.append((indent, name))
            files.add(path + "__init__.py")
        else:
            files.add(path)
    return files


def test_the_how_it_works_tree_lists_every_module() -> None:
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    assert "capture/root_hook.py" in modules and "capture/root_hook.py" in _tree_files()
    assert sorted(modules - _tree_files()) == [], "modules missing from docs/how-it-works.md's tree"
    assert sorted(_tree_files() - modules) == [], "docs/how-it-works.md's tree names modules that do not exist"


def test_no_import_cycle_inside_actviz() -> None:
    graph = _import_graph()
    assert "actviz.report.results" in graph["actviz.report.html"]  # the graph sees relative imports
    assert "actviz.capture.layer_outputs" in graph["actviz.report.capture"]
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


_BLOCK = """
import sys


class Refuse:
    '''Makes `import torchvision` and `import tqdm` fail, as if they were not installed.'''

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchvision", "tqdm"):
            raise ImportError(f"{name} is blocked by the test")
        return None


sys.meta_path.insert(0, Refuse())
"""

_WATCH = """
import sys
import torch
import pytest

import actviz

model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2))
with actviz.watch(model, sys.argv[1], every=1, image_every=IMAGE_EVERY, options=actviz.Options(strict=True)) as viz:
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    viz.flush()
    print("torchvision" in sys.modules)
"""


def _python(code: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_watch_runs_without_torchvision_and_tqdm_when_it_draws_no_picture(tmp_path: Path, read_run) -> None:
    # torch imports tqdm itself when it is installed (torch.hub), so "not in sys.modules" can't
    # be tested for tqdm; refusing both imports shows that watch() needs neither.
    assert _python(_BLOCK + _WATCH.replace("IMAGE_EVERY", "lambda step: False"), str(tmp_path)) == "False"
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == [0] and run.histogram_steps("weight_grads/3.weight") == [0]
    assert run.image_tags == set()


def test_torchvision_is_imported_when_the_first_picture_is_drawn(tmp_path: Path, read_run) -> None:
    code = "import sys, actviz; print('torchvision' in sys.modules)\n" + _WATCH.replace("IMAGE_EVERY", "1")
    assert _python(code, str(tmp_path)).split() == ["False", "True"]  # not by import actviz; by drawing
    assert read_run(tmp_path).image_steps("feature_maps/0") == [0]


#: Calls that change something outside actviz's own objects for the whole process.
PROCESS_WIDE = re.compile(r"^(register_optimizer_step_(pre|post)_hook|register_module_\w+|register_\w*global\w*|"
                          r"register_at_fork|replace_record_checksum|set_excepthook)$")


def _side_effect_section() -> str:
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    return text.split("\n## Side effects\n", 1)[1].split("\n## ", 1)[0]


def _process_wide_calls(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if PROCESS_WIDE.match(name) or ast.unparse(node.func) == "atexit.register":
                found.append(f"{node.lineno}: {ast.unparse(node.func)}")
        elif isinstance(node, ast.Assign) and any(ast.unparse(target) in ("sys.excepthook", "threading.excepthook")
                                                  for target in node.targets):
            found.append(f"{node.lineno}: {ast.unparse(node.targets[0])} =")
    return sorted(found, key=lambda use: int(use.split(":", 1)[0]))


def test_every_process_wide_side_effect_is_made_in_a_module_the_docs_name() -> None:
    from test_idioms import second_spellings

    section = _side_effect_section()
    named = {match.replace(".", "/") for match in re.findall(r"actviz[/.]([\w/.]*\w)", section)}
    named = {name.removesuffix("/py") for name in named} | {name.rsplit("/", 1)[0] for name in named}
    assert {"common/optimizer_steps", "output/open_watchers", "common/distributed_types", "common/_internals",
            "output/tensorboard"} <= named
    unnamed, making = {}, set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE).with_suffix(""))
        source = path.read_text()
        made = _process_wide_calls(ast.parse(source))
        made += [use for use in second_spellings(source) if use.startswith("class name check")]
        if made:
            making.add(module)
        if made and module not in named:
            unnamed[module] = made
    assert {"common/optimizer_steps", "output/open_watchers", "common/distributed_types",
            "output/tensorboard"} <= making  # the scan sees them
    assert unnamed == {}, "a process-wide side effect (or a check by class name) in a module that the " \
                          "Side effects section of docs/how-it-works.md does not name: add it there, or move it"


def test_the_side_effect_scan_sees_each_kind() -> None:
    code = """
import atexit, sys
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.nn.modules.module import register_module_forward_hook
atexit.register(print)
register_optimizer_step_pre_hook(hook)
register_module_forward_hook(hook)
torch.optim.optimizer.register_optimizer_step_post_hook(hook)
sys.excepthook = hook
model.register_forward_hook(hook)  # a hook on the user's model is not process-wide
"""
    assert _process_wide_calls(ast.parse(code)) == [
        "5: atexit.register", "6: register_optimizer_step_pre_hook", "7: register_module_forward_hook",
        "8: torch.optim.optimizer.register_optimizer_step_post_hook", "9: sys.excepthook ="]


def test_project_urls_point_at_this_repository_and_at_files_it_has() -> None:
    # The address itself cannot be checked offline (the repository is not public yet); what it points
    # into can: each URL sits under the homepage, and a /blob/main/ link names a file of this checkout.
    tomllib = pytest.importorskip("tomllib")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    home = urls["Homepage"].rstrip("/")
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", home)
    for name, url in urls.items():
        assert url == home or url.startswith(home + "/"), f"{name}: {url} is not under {home}"
        if "/blob/main/" in url:
            assert (ROOT / url.split("/blob/main/", 1)[1]).is_file(), f"{name}: {url} names no file of the repository"


def test_the_changelog_has_a_section_for_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(actviz.__version__)}\b", text, flags=re.M), (
        f"CHANGELOG.md has no '## {actviz.__version__}' section: add one when the version changes")

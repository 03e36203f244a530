"""Private APIs of other libraries are reached only through actviz/common/_internals.py (PyTorch, torchvision) and
actviz/common/_tensorboard_internals.py (TensorBoard).

Outside those two, actviz code may use a name that starts with one underscore only
on ``self``/``cls`` or when actviz itself defines that name (a method, attribute, function or
class of its own) and no torch module, tensor, optimizer, grad scaler or ``SummaryWriter`` has
an attribute of that name. Anything else is another library's private attribute and fails here: an
attribute (``module._forward_hooks``), a ``getattr``-family call with a literal name
(``getattr(model, "_orig_mod")``) or an import (``import torch._dynamo``,
``from torch.nn.modules.batchnorm import _NormBase``). A name reached through another
library's module (``torch.nn.functional._pad``, ``F._canonical_mask``) is foreign even where
actviz has a name of its own that reads the same. Add one small function to
``_internals.py`` instead, with a test in tests/test_internals.py that fails when a release
changes what it relies on.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "actviz"

#: torch's multi-tensor ops: private by name, but the documented way to batch small tensors;
#: tests/test_internals.py checks what actviz relies on.
ALLOWED_PREFIXES = ("_foreach_",)

def _private_names_of_the_objects_actviz_touches() -> set[str]:
    """The private attributes of a module, a tensor, an optimizer, a grad scaler and a SummaryWriter."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    layer = torch.nn.Linear(1, 1)
    objects = (layer, torch.zeros(1), torch.optim.SGD(layer.parameters(), lr=0.1),
               torch.amp.GradScaler("cpu", enabled=False))
    names = {name for value in objects for name in [*dir(value), *vars(value)]} | set(dir(SummaryWriter))
    return {name for name in names if _private(name)}


#: torch's own private attributes: foreign even where an actviz class has one of the same name
#: (``other._values`` is a tensor's, whatever ``self._values`` is in actviz).
ALWAYS_FOREIGN = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks", "_version", "_base", "_grad_fn", "_orig_mod", "_compiled_call_impl"}

#: Uses from before this test, each to be moved into _internals.py. The test fails once one
#: is gone, so that this list only ever shrinks.
KNOWN = {("summaries/fused.py", "import torch._dynamo")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(trees: list[ast.Module]) -> set[str]:
    """Private names actviz defines: functions, classes, module globals and attributes it assigns."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and ast.unparse(node.value) in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {name for name in names if _private(name)} - ALWAYS_FOREIGN - _private_names_of_the_objects_actviz_touches()


def library_names(tree: ast.Module) -> set[str]:
    """Names ``tree`` binds to another library's modules and objects by importing them (``torch``, ``F``, ``nn``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] != "actviz"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in (None, "__future__"):
            if node.module.split(".")[0] != "actviz":
                names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from: ``torch`` for ``torch.nn.functional._pad``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_private_uses(tree: ast.Module, own: set[str]) -> list[str]:
    """``'line: use'`` for each private name of another library that ``tree`` reaches for."""
    found: list[tuple[int, str]] = []

    def foreign(name: str) -> bool:
        return _private(name) and name not in own and not name.startswith(ALLOWED_PREFIXES)

    libraries = library_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (foreign(node.attr) or (
                _private(node.attr) and not node.attr.startswith(ALLOWED_PREFIXES) and _root(node) in libraries)):
            base = ast.unparse(node.value)
            if base not in ("self", "cls"):
                found.append((node.lineno, f"{base}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and foreign(node.args[1].value)):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if any(_private(part) for part in alias.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            if any(_private(part) for part in (node.module or "").split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if _private(alias.name)]
    return [f"{line}: {use}" for line, use in sorted(found)]


def test_no_module_but_internals_reaches_into_another_librarys_private_names() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = {path: ast.parse(path.read_text()) for path in paths}
    own = own_private_names(list(trees.values()))
    seen_known: set[tuple[str, str]] = set()
    bad: dict[str, list[str]] = {}
    for path, tree in trees.items():
        if path.name in ("_internals.py", "_tensorboard_internals.py"):
            continue
        relative = str(path.relative_to(PACKAGE))
        for use in foreign_private_uses(tree, own):
            if (relative, use.split(": ", 1)[1]) in KNOWN:
                seen_known.add((relative, use.split(": ", 1)[1]))
            else:
                bad.setdefault(relative, []).append(use)
    assert not bad, f"private names of other libraries outside actviz/common/_internals.py and _tensorboard_internals.py: {bad}"
    assert seen_known == KNOWN, f"gone, take them off KNOWN in this test: {sorted(KNOWN - seen_known)}"


def test_the_guard_sees_each_way_in() -> None:
    code = '''
import torch._dynamo
from torch.nn.modules.batchnorm import _NormBase
from torch._C import something


class Mine:
    def __init__(self, model):
        self._model = model
        self._helper()
        count = len(model._forward_hooks)
        original = getattr(model, "_orig_mod", None)
        ours = other_watcher._model
        params = model._parameters
        norms = torch._foreach_norm([model.weight])
        padded = F._helper(model.weight)
        self._values = model.weight._values()

    def _helper(self):
        return self.__class__.__name__
'''
    code = "import torch.nn.functional as F" + code  # F's names are another library's, _helper too
    tree = ast.parse(code)
    assert foreign_private_uses(tree, own_private_names([tree])) == [
        "2: import torch._dynamo",
        "3: from torch.nn.modules.batchnorm import _NormBase",
        "4: from torch._C import ...",
        "11: model._forward_hooks",
        "12: getattr(..., '_orig_mod')",
        "14: model._parameters",
        "16: F._helper",
        "17: model.weight._values",
    ]

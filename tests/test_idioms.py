"""One helper per idiom: what each helper does, and that no module of actviz spells one out again.

=============================  ===================================  =====================================
idiom                          the helper                           a second spelling fails here
=============================  ===================================  =====================================
"did you mean" in an error     ``actviz.common.suggestions.did_you_mean``  ``difflib`` imported elsewhere
a layer looked up by name      ``actviz.selection.find_layer``      ``get_submodule`` or a dict of
                                                                    ``named_modules()`` elsewhere
values in [0, 1] to pixels     ``actviz.common.pixels.to_uint8``           ``* 255`` and ``uint8`` on one line
DTensor, FSDP, DDP by name     ``actviz.common.distributed_types``         ``type(x).__name__`` compared, or the
                                                                    class names as strings, elsewhere
a list of hook handles         ``actviz.common.owned_hooks.HookHandles``         a loop that calls ``.remove()`` on
                                                                    each item, elsewhere
=============================  ===================================  =====================================
"""

from __future__ import annotations

import ast
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hooks_left
from torch import nn

from actviz.common.distributed_types import is_ddp, is_dtensor, is_fsdp_parameter
from actviz.common.owned_hooks import HookHandles
from actviz.common.pixels import to_uint8
from actviz.selection import find_layer
from actviz.common.suggestions import closest, did_you_mean

PACKAGE = Path(__file__).resolve().parents[1] / "actviz"


# -- what each helper does -------------------------------------------------------------------------


def test_did_you_mean_offers_the_closest_names_best_first() -> None:
    known = ["vanishing_ratio", "exploding_ratio", "warmup_steps"]
    assert did_you_mean("vanish_ratio", known) == "; did you mean 'vanishing_ratio'?"
    assert did_you_mean("feature.0", ["head", "features.10", "features.0"], n=2) == (
        "; did you mean 'features.0' or 'features.10'?")  # the closer first, whatever the order given
    assert did_you_mean("vgg61", ["vgg16", "vgg11", "resnet18"], n=4, sep=", ") == "; did you mean 'vgg16', 'vgg11'?"
    assert did_you_mean("zzz", known) == ""
    assert did_you_mean("zzz", known, otherwise="; known: a, b") == "; known: a, b"
    assert closest("conv", {"conv": 1, "relu": 2}) == ["conv"]  # any iterable of names, a dict's keys too
    assert closest("cnv", ["conv"], cutoff=0.9) == [] and closest("cnv", ["conv"], cutoff=0.5) == ["conv"]


def test_every_did_you_mean_of_the_package_reads_the_same() -> None:
    import actviz
    from actviz.diagnosis.alerts import check_alerts

    model = nn.Sequential(OrderedDict(features=nn.Sequential(nn.Conv2d(3, 4, 3)), head=nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"^unknown layer 'feature\.0'; did you mean 'features\.0' or 'features'\?$"):
        actviz.selection.select_layers(model, "feature.0")
    with pytest.raises(ValueError, match=r"^unknown alert threshold 'vanish_ratio'; did you mean 'vanishing_ratio'\?$"):
        check_alerts({"vanish_ratio": 1.0})
    with pytest.raises(ValueError, match=r"^unknown layer 'feature\.0' for Grad-CAM; did you mean 'features\.0' or "):
        actviz.pictures.gradcam.grad_cam(model, "feature.0", torch.randn(1, 3, 8, 8))


def test_find_layer_returns_the_module_itself_at_any_depth() -> None:
    inner = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    model = nn.Sequential(OrderedDict(features=inner, head=nn.Linear(4, 2)))
    assert find_layer(model, "features.1") is inner[1]
    assert find_layer(model, "head") is model.head
    assert find_layer(model, "") is model
    shared = nn.ReLU()
    twice = nn.Sequential(OrderedDict(a=shared, b=shared))  # named_modules() names it once, as 'a'
    assert find_layer(twice, "b") is shared


def test_find_layer_names_the_bad_name_the_place_and_the_closest() -> None:
    model = nn.Sequential(OrderedDict(features=nn.Sequential(nn.Conv2d(3, 4, 3)), head=nn.Linear(4, 2)))
    with pytest.raises(ValueError) as raised:
        find_layer(model, "haed", " in gradcam='haed'")
    assert str(raised.value) == "unknown layer 'haed' in gradcam='haed'; did you mean 'head'?"
    with pytest.raises(ValueError, match=r"^unknown layer 'features\.9'; did you mean 'features\.0' or 'features'\?$"):
        find_layer(model, "features.9")
    with pytest.raises(ValueError, match=r"^unknown layer 'xyz'$"):
        find_layer(model, "xyz")
    with pytest.raises(ValueError, match="unknown layer 'head.weight'"):  # a parameter is not a layer
        find_layer(model, "head.weight")


def test_to_uint8_rounds_half_to_even_clamps_and_leaves_its_input() -> None:
    values = torch.tensor([0.0, 0.5, 1 / 255, 2.5 / 255, 1.0, 1.2, -0.3, 0.999], dtype=torch.float64)
    before = values.clone()
    pixels = to_uint8(values)
    # by hand: 127.5 -> 128 (even), 1 -> 1, 2.5 -> 2 (even), 254.745 -> 255; out of range clamped
    assert pixels.dtype == torch.uint8 and pixels.tolist() == [0, 128, 1, 2, 255, 255, 0, 255]
    assert torch.equal(values, before)
    assert to_uint8(torch.full((3, 2, 2), 0.25)).shape == (3, 2, 2)
    array = np.array([[0.0, 0.5], [2.5 / 255, 7.0]])
    assert to_uint8(array).dtype == np.uint8 and to_uint8(array).tolist() == [[0, 128], [2, 255]]
    assert array[1, 1] == 7.0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="a PyTorch build without torch.distributed")
def test_distributed_types_are_told_by_the_names_torch_gives_its_classes() -> None:
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    def like(cls: type) -> object:  # an object whose class has torch's class name, without a process group
        return type(cls.__name__, (), {})()

    assert is_dtensor(like(DTensor)) and is_fsdp_parameter(like(DTensor))
    assert is_ddp(like(DistributedDataParallel))
    assert is_fsdp_parameter(type("FlatParameter", (), {})())
    plain = nn.Linear(2, 2)
    assert not any(check(value) for check in (is_dtensor, is_fsdp_parameter, is_ddp)
                   for value in (plain, plain.weight, torch.zeros(2), None))


def test_hook_handles_are_removed_when_the_block_ends_by_an_exception_too() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with HookHandles() as handles:
        for module in model:
            handles.add("forward", module.register_forward_hook(lambda *args: None))
            handles.add("pre", module.register_forward_pre_hook(lambda *args: None))
        assert hooks_left(model)["forward"] == 2 and hooks_left(model)["forward_pre"] == 2
    assert hooks_left(model) == dict.fromkeys(hooks_left(model), 0)
    with pytest.raises(KeyError), HookHandles() as handles:
        handles.add("forward", model[0].register_forward_hook(lambda *args: None))
        raise KeyError("the model failed")
    assert hooks_left(model)["forward"] == 0
    handles.remove()  # again: nothing left, nothing raised


def test_the_models_hooks_are_gone_after_a_probe_or_report_pass_that_raises() -> None:
    from actviz.transformers.attention_maps import record_attention
    from actviz.report.capture import capture_layers

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken")

    model = nn.Sequential(nn.Conv2d(3, 4, 3), Broken())
    with pytest.raises(RuntimeError, match="broken"):
        capture_layers(model, torch.randn(1, 3, 8, 8), [("0", model[0]), ("1", model[1])])
    assert hooks_left(model)["forward"] == 0
    layer = nn.TransformerEncoderLayer(8, 2, batch_first=True).eval()
    with pytest.raises(RuntimeError, match="broken"), torch.no_grad(), record_attention(layer):
        raise RuntimeError("broken")
    assert hooks_left(layer)["forward"] == 0 and hooks_left(layer)["forward_pre"] == 0


# -- no second spelling ----------------------------------------------------------------------------

_SCALE = re.compile(r"\*\s*255\b|\bmul_?\(255\)")
_UINT8 = re.compile(r"\b(?:torch|np)\.uint8\b|\.byte\(\)|astype\(\s*\"uint8\"")
_CLASS_NAMES = {"DTensor", "FlatParameter", "DistributedDataParallel"}


def _is_type_name(node: ast.AST) -> bool:
    """``type(x).__name__`` or ``x.__class__.__name__``."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and (
        (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "type")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "__class__"))


def second_spellings(source: str) -> list[str]:
    """``'idiom, line N'`` for each idiom that ``source`` spells out itself instead of calling its helper."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name == "difflib" for alias in node.names) or (
                isinstance(node, ast.ImportFrom) and node.module == "difflib"):
            found.append((node.lineno, "did you mean (difflib)"))
        elif isinstance(node, ast.Attribute) and node.attr == "get_submodule":
            found.append((node.lineno, "layer lookup (get_submodule)"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and node.args
              and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)
              and node.args[0].func.attr == "named_modules"):
            found.append((node.lineno, "layer lookup (dict of named_modules)"))
        elif isinstance(node, ast.Compare) and any(map(_is_type_name, [node.left, *node.comparators])):
            found.append((node.lineno, "class name check"))
        elif (isinstance(node, ast.Constant) and node.value in _CLASS_NAMES and id(node) not in docstrings):
            found.append((node.lineno, "class name check"))
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and any(
                isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "remove"
                and isinstance(call.func.value, ast.Name) and call.func.value.id == node.target.id and not call.args
                for statement in node.body for call in ast.walk(statement)):
            found.append((node.lineno, "hook-handle list"))
        elif isinstance(node, ast.While) and isinstance(node.test, ast.Name) and any(  # while handles: handles[-1].remove()
                isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "remove"
                and isinstance(call.func.value, ast.Subscript) and isinstance(call.func.value.value, ast.Name)
                and call.func.value.value.id == node.test.id and not call.args
                for statement in node.body for call in ast.walk(statement)):
            found.append((node.lineno, "hook-handle list"))
    for number, line in enumerate(source.splitlines(), 1):
        if _SCALE.search(line) and _UINT8.search(line):
            found.append((number, "float to uint8"))
    return [f"{idiom}, line {number}" for number, idiom in sorted(found)]


#: The module that holds each idiom's one spelling, with the idioms it may spell.
HOMES = {
    "common/suggestions.py": {"did you mean (difflib)"},
    "selection.py": {"layer lookup (get_submodule)"},
    "common/pixels.py": {"float to uint8"},
    "common/distributed_types.py": {"class name check"},
    "common/owned_hooks.py": {"hook-handle list"},
}


def test_no_module_spells_an_idiom_out_again() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        allowed = HOMES.get(path.relative_to(PACKAGE).as_posix(), set())
        uses = [use for use in second_spellings(path.read_text()) if use.rsplit(", ", 1)[0] not in allowed]
        if uses:
            found[str(path.relative_to(PACKAGE))] = uses
    assert found == {}, "call the idiom's helper (see tests/test_idioms.py's docstring) instead"


def test_each_home_holds_its_idiom() -> None:  # else the check above could pass by seeing nothing
    for name, idioms in HOMES.items():
        spelled = {use.rsplit(", ", 1)[0] for use in second_spellings((PACKAGE / name).read_text())}
        assert idioms <= spelled, name


def test_the_check_sees_each_old_spelling() -> None:
    old = '''
import difflib
from difflib import get_close_matches


def lookups(model, layer, image, tensor, param, handles):
    module = model.get_submodule(layer)
    modules = dict(model.named_modules())
    pixels = image.mul(255).round().clamp(0, 255).to(torch.uint8)
    gray = np.clip(np.round(values / peak * 255.0), 0, 255).astype(np.uint8)
    levels = values.mul_(255).round_().byte()
    if type(tensor).__name__ == "DTensor" or "FlatParameter" in type(param).__name__:
        pass
    if model.__class__.__name__ in ("DistributedDataParallel",):
        pass
    for handle in handles:
        handle.remove()
    colours = table.float() / 255  # not a conversion to pixels
    index = np.clip(position * 255, 0, 255).astype(np.intp)  # a colour table's index, not pixels
'''
    assert second_spellings(old) == [
        "did you mean (difflib), line 2",
        "did you mean (difflib), line 3",
        "layer lookup (get_submodule), line 7",
        "layer lookup (dict of named_modules), line 8",
        "float to uint8, line 9",
        "float to uint8, line 10",
        "float to uint8, line 11",
        "class name check, line 12",  # two comparisons of a class's name, two of the names as strings
        "class name check, line 12",
        "class name check, line 12",
        "class name check, line 12",
        "class name check, line 14",
        "class name check, line 14",
        "hook-handle list, line 16",
    ]

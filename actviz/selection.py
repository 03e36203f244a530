"""Selection: which layers of a model to watch or report.

Pure functions over ``model.named_modules()``. Names are resolved once, when
the watcher is built, and every spec must match something. :func:`actviz.watch`
and :func:`actviz.report` (``actviz report --layers``) share this vocabulary,
keywords included.
"""

from __future__ import annotations

import copy  # noqa: F401  (the example's)
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .common.suggestions import closest, did_you_mean

__all__ = ["LAYER_KEYWORDS", "LayerSpec", "ROOT_NAME", "select_layers", "default_layers", "find_layer", "layer_display_name",
           "layer_tag_names", "parameter_tag_names"]

#: One entry of ``watch(layers=...)``: a module type, a keyword, a qualified name, a
#: glob pattern on names, a module object, or a predicate ``(name, module) -> bool``.
LayerSpec = type | str | nn.Module | Callable[[str, nn.Module], bool]

#: Strings that select layers by type, not by name. A keyword wins over a layer of the same
#: name (ResNet has a layer named ``relu``, and ``"relu"`` still means every ReLU); select
#: such a layer by its module object or by a glob that matches only its name (``"rel[u]"``).
LAYER_KEYWORDS: dict[str, str] = {
    "conv": "every nn.Conv2d",
    "relu": "every nn.ReLU",
    "all": "every module without children",
}
_KEYWORD_TYPES: dict[str, tuple[type[nn.Module], ...]] = {"conv": (nn.Conv2d,), "relu": (nn.ReLU,)}

#: Tag name used for the watched model itself (``named_modules()`` calls it "").
ROOT_NAME = "(model)"

_GLOB_CHARS = frozenset("*?[")


#: A ``named_modules()`` name up to this long is its own tag name; a longer one is shortened by :func:`layer_tag_names`.
SHORT_NAME = 12
#: A shortened name longer than this has its middle words cut to their first letter (``0.a.o.dense``).
ABBREVIATE_OVER = 16


def layer_display_name(name: str) -> str:
    """The name of a module in messages, given its ``named_modules()`` name: the model itself is :data:`ROOT_NAME`."""
    return name if name else ROOT_NAME


def _tails(name: str, last_words: Counter[str]) -> list[str]:
    """``name``'s candidate tag names, shortest first; the last is ``name`` itself.

    Each is a dotted tail of ``name`` after the numbers (block indices) before it: ``bert.encoder.layer.0.attention.
    self.query`` -> ``0.query``, ``0.self.query``, ... A tail of numbers alone says nothing, and a single word that
    other modules also end with (``dense``) needs its parent (``pooler.dense``) when no number tells it apart.
    """
    parts = name.split(".")
    tails = []
    for start in range(len(parts) - 1, -1, -1):
        tail, numbers = parts[start:], [part for part in parts[:start] if part.isdigit()]
        if all(part.isdigit() for part in tail) or (not numbers and len(tail) == 1 and last_words[tail[0]] > 1):
            continue
        tails.append(".".join(numbers + tail))
    return list(dict.fromkeys(tails + [name]))


def _abbreviated(tag_name: str) -> str:
    """``tag_name`` from its first number on, its words but the last cut to their first letter:
    ``0.attention.output.dense`` -> ``0.a.o.dense``, ``layer.0.output.dense`` -> ``0.o.dense``."""
    parts = tag_name.split(".")
    first_number = next((index for index, part in enumerate(parts[:-1]) if part.isdigit()), 0)
    *middle, last = parts[first_number:]
    # A wrapper's private attribute (FSDP1's ``_fsdp_wrapped_module``) stays whole: its first letter says nothing.
    return ".".join([part if part.isdigit() or part.startswith("_") else part[0] for part in middle] + [last])


def layer_tag_names(model: nn.Module) -> dict[str, str]:
    """The tag name of each module of ``model``, by ``named_modules()`` name: the one rule every actviz tag follows.

    A name of up to :data:`SHORT_NAME` characters is kept (``features.0``, ``fc``). A longer one becomes the
    shortest dotted tail that no other module of the model could be called, after the block numbers it drops:
    ``bert.encoder.layer.0.attention.self.query`` -> ``0.query``, ``bert.pooler.dense`` -> ``pooler.dense``.
    Past :data:`ABBREVIATE_OVER` characters its middle words are cut to their first letter:
    ``bert.encoder.layer.0.attention.output.dense`` -> ``0.a.o.dense``, ``bert.encoder.layer.0.output.dense`` ->
    ``0.o.dense``. That part tells layers apart, and it
    fits where TensorBoard's Time Series cuts a long card title. Names are unique (a clash keeps the full name);
    the model itself is :data:`ROOT_NAME`. A run's ``layers`` text lists each tag name beside the module's name.

    Example:
        >>> block = nn.ModuleDict({"attention": nn.ModuleDict({"query": nn.Linear(2, 2), "key": nn.Linear(2, 2)}),
        ...                        "output": nn.Linear(2, 2)})
        >>> model = nn.ModuleDict({"encoder": nn.ModuleList([block, copy.deepcopy(block)]), "head": nn.Linear(2, 2)})
        >>> names = layer_tag_names(model)
        >>> names["encoder.0.attention.query"], names["encoder.1.output"], names["head"], names[""]
        ('0.query', '1.output', 'head', '(model)')
    """
    names = [name for name, _ in model.named_modules()]
    last_words = Counter(name.rsplit(".", 1)[-1] for name in names if name)
    tails = {name: _tails(name, last_words) for name in names if len(name) > SHORT_NAME}
    claims = Counter(tail for name in names for tail in (tails.get(name) or [name]))
    chosen = {name: next((tail for tail in tails[name] if claims[tail] == 1), name) if name in tails
              else layer_display_name(name) for name in names}
    short = {name: _abbreviated(tag) if len(tag) > ABBREVIATE_OVER else tag for name, tag in chosen.items()}
    taken = Counter(short.values())
    return {name: short[name] if taken[short[name]] == 1 else chosen[name] for name in names}


def parameter_tag_names(model: nn.Module) -> dict[str, str]:
    """The tag name of each parameter of ``model``, by ``named_parameters()`` name: its module's tag name
    (:func:`layer_tag_names`), a dot, and its own name.

    Example:
        >>> model = nn.ModuleDict({"encoder": nn.ModuleList([nn.ModuleDict({"attention": nn.Linear(2, 2)})])})
        >>> parameter_tag_names(model)["encoder.0.attention.bias"]
        '0.attention.bias'
    """
    modules = layer_tag_names(model)
    return {name: f"{modules.get(owner, owner)}.{own}" if owner else own
            for name, _ in model.named_parameters() for owner, _, own in [name.rpartition(".")]}


def find_layer(model: nn.Module, name: str, where: str = "") -> nn.Module:
    """The module of ``model`` named ``name`` (``""`` is the model), or a ``ValueError`` with a "did you mean".

    Args:
        model: The model to look in.
        name: A ``named_modules()`` name, e.g. ``"features.0"``.
        where: Said after the name in the error, e.g. ``" for Grad-CAM"``.

    Example:
        >>> from collections import OrderedDict
        >>> net = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 8, 3), relu=nn.ReLU()))
        >>> find_layer(net, "relu")
        ReLU()
        >>> find_layer(net, "conv1", " for Grad-CAM")
        Traceback (most recent call last):
        ...
        ValueError: unknown layer 'conv1' for Grad-CAM; did you mean 'conv'?
    """
    try:
        return model.get_submodule(name)
    except AttributeError:
        names = [known for known, _ in model.named_modules() if known]
        raise ValueError(f"unknown layer {name!r}{where}{did_you_mean(name, names, n=2)}") from None


def owns_parameters(module: nn.Module) -> bool:
    """True if ``module`` has parameters of its own (not only through children)."""
    return next(module.parameters(recurse=False), None) is not None


def default_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module that owns parameters directly: Conv*, Linear, norms, Embedding, RNNs, attention.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
        >>> [name for name, _ in default_layers(net)]
        ['0', '3']
    """
    return [(name, module) for name, module in model.named_modules() if owns_parameters(module)]


#: What ``nn.Module.__init__`` keeps in every module's ``__dict__`` (``_modules`` and the like).
_MODULE_STATE = frozenset(vars(nn.Module()))


def _unregistered(model: nn.Module) -> tuple[list[str], list[str]]:
    """Attributes of ``model`` that PyTorch does not register: containers of modules, and tensors that require grad."""
    containers, tensors = [], []
    for attribute, value in vars(model).items():
        if attribute in _MODULE_STATE:
            continue
        items = list(value.values()) if isinstance(value, dict) else value
        if isinstance(value, (list, tuple, dict)) and any(isinstance(item, nn.Module) for item in items):
            kinds = sorted({type(item).__name__ for item in items if isinstance(item, nn.Module)})
            fix = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
            containers.append(f"self.{attribute} is a plain Python {type(value).__name__} of {len(items)} "
                              f"({', '.join(kinds)}): write self.{attribute} = {fix}(...)")
        elif isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(value, nn.Parameter):
            tensors.append(f"self.{attribute} is a tensor that requires grad: wrap it in nn.Parameter(...)")
    return containers, tensors


def no_default_layers_message(model: nn.Module) -> str:
    """Why ``model`` has no layer to watch by default, and a fix that works for it.

    Example:
        >>> class Net(nn.Module):  # pytorch/examples' forward-forward network keeps its layers like this
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
        >>> print(no_default_layers_message(Net()))  # doctest: +NORMALIZE_WHITESPACE
        Net has no parameters that PyTorch can see, so no layer to watch by default: self.layers is a plain
        Python list of 2 (Linear): write self.layers = nn.ModuleList(...). Modules kept in a plain list,
        tuple or dict are not registered: model.parameters(), model.to(), state_dict() and actviz all miss them.
    """
    name = type(model).__name__
    containers, tensors = _unregistered(model)
    if containers or tensors:
        return (f"{name} has no parameters that PyTorch can see, so no layer to watch by default: "
                + "; ".join(containers + tensors) + ". "
                + ("Modules kept in a plain list, tuple or dict are not registered: model.parameters(), "
                   "model.to(), state_dict() and actviz all miss them." if containers else
                   "A plain tensor is not a parameter: model.parameters() and optimizers miss it."))
    has_relu = any(isinstance(module, nn.ReLU) for module in model.modules())
    if next(model.children(), None) is None:
        choice = "layers='all' to watch the model's own output"
    else:
        choice = "layers='all' (every module without children)" + (" or layers='relu'" if has_relu else "")
    return f"{name} has no module with parameters to watch by default; pass {choice}, or name the layers to watch"


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    names = [c for c in candidates if c]
    # A glob like "clasifier.*" compares better without its wildcards.
    hint = did_you_mean(word, names, n=3, cutoff=0.5) or did_you_mean(word.strip("*?[]. "), names, n=3, cutoff=0.4)
    if hint:
        return hint
    keyword = closest(word, LAYER_KEYWORDS, n=1, cutoff=0.6)
    if keyword:
        return f"; did you mean the keyword {keyword[0]!r} ({LAYER_KEYWORDS[keyword[0]]})?"
    preview = ", ".join(repr(c) for c in list(candidates)[1:9])
    return f"; the model's layers include {preview}" if preview else ""


def _class_hint(word: str, modules: list[tuple[str, nn.Module]]) -> str:
    """``"; 'Linear' is a class name: ..."`` where ``word`` names a module class (the model's, or ``torch.nn``'s), not a layer.

    Example:
        >>> _class_hint("Linear", [("0", nn.Linear(2, 2))])
        "; 'Linear' is a class name, not a layer name: pass the class, layers=nn.Linear (1 of this model's modules are one)"
    """
    classes = {type(module).__name__: type(module) for _, module in modules}
    found = classes.get(word) or next((cls for name, cls in classes.items() if name.lower() == word.lower()), None)
    if found is None:
        found = getattr(nn, word, None) if isinstance(getattr(nn, word, None), type) else None
        found = found or next((getattr(nn, name) for name in dir(nn) if name.lower() == word.lower()
                               and isinstance(getattr(nn, name), type) and issubclass(getattr(nn, name), nn.Module)), None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        return ""
    count = sum(isinstance(module, found) for _, module in modules)
    spelled = f"nn.{found.__name__}" if getattr(nn, found.__name__, None) is found else found.__name__
    held = f"{count} of this model's modules are one" if count else "this model has none"
    return f"; {word!r} is a class name, not a layer name: pass the class, layers={spelled} ({held})"


def _match_one(spec: LayerSpec, modules: list[tuple[str, nn.Module]]) -> list[str]:
    """Names matched by one spec, raising with a helpful message when none match."""
    names = [name for name, _ in modules]
    if isinstance(spec, str) and spec in LAYER_KEYWORDS:
        return _match_keyword(spec, modules)
    if isinstance(spec, str):
        if _GLOB_CHARS & set(spec):
            matched = [name for name in names if name and fnmatch.fnmatchcase(name, spec)]
            if not matched:
                raise ValueError(f"layer pattern {spec!r} matches no layer{_did_you_mean(spec, names)}")
            return matched
        if spec not in names:
            raise ValueError(f"unknown layer {spec!r}{_class_hint(spec, modules) or _did_you_mean(spec, names)}")
        return [spec]
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise TypeError(f"layer type must be an nn.Module subclass, got {spec.__name__}")
        matched = [name for name, module in modules if isinstance(module, spec)]
        if not matched:
            present = sorted({type(m).__name__ for _, m in modules})
            raise ValueError(
                f"no layer of type {spec.__name__} in the model; types present: {', '.join(present)}"
            )
        return matched
    if isinstance(spec, nn.Module):
        matched = [name for name, module in modules if module is spec]
        if not matched:
            raise ValueError(f"module {type(spec).__name__} given in layers= is not part of the model")
        return matched[:1]
    if callable(spec):
        matched = [name for name, module in modules if spec(name, module)]
        if not matched:
            raise ValueError(f"layer predicate {getattr(spec, '__name__', spec)!r} matched no layer")
        return matched
    raise TypeError(
        "each entry of layers= must be a module type, a name, a glob pattern, a module or a "
        f"predicate (name, module) -> bool; got {type(spec).__name__}: {spec!r}"
    )


def _match_keyword(keyword: str, modules: list[tuple[str, nn.Module]]) -> list[str]:
    if keyword == "all":
        leaves = [name for name, module in modules if name and next(module.children(), None) is None]
        return leaves or [modules[0][0]]  # a model without children is its one layer
    kinds = _KEYWORD_TYPES[keyword]
    matched = [name for name, module in modules if isinstance(module, kinds)]
    if not matched:
        present = sorted({type(m).__name__ for _, m in modules})
        raise ValueError(
            f"layers={keyword!r} selects {LAYER_KEYWORDS[keyword]}, and the model has none; "
            f"types present: {', '.join(present)}. Pass 'all', a module type or layer names"
        )
    return matched


def select_layers(
    model: nn.Module, layers: LayerSpec | Iterable[LayerSpec] | None = None
) -> list[tuple[str, nn.Module]]:
    """Resolve a layer spec to ``(name, module)`` pairs, in ``named_modules()`` order.

    Args:
        model: The model whose layers to select.
        layers: ``None`` for :func:`default_layers`, or one spec or an iterable of specs.
            Each spec is a module type (``nn.Conv2d``), a keyword (``"conv"``: every
            ``Conv2d``; ``"relu"``: every ``ReLU``; ``"all"``: every module without
            children), a qualified name (``"features.0"``), a glob on names
            (``"classifier.*"``), a module object, or a predicate ``(name, module) -> bool``.
            The union of all matches is returned. A keyword wins over a layer of the same
            name; a glob such as ``"con[v]"`` or the module object selects that layer.

    Returns:
        The selected layers, each once, in the order ``model.named_modules()`` yields them.

    Raises:
        ValueError: A spec matches nothing; the message names the closest layer names.
        TypeError: A spec is of an unsupported type.

    Example:
        >>> from collections import OrderedDict
        >>> net = nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 8, 3), relu=nn.ReLU(), conv2=nn.Conv2d(8, 8, 3)))
        >>> [name for name, _ in select_layers(net, [nn.Conv2d])]
        ['conv1', 'conv2']
        >>> [name for name, _ in select_layers(net, "conv*")]
        ['conv1', 'conv2']
        >>> [name for name, _ in select_layers(net, ["relu", "conv2"])]   # a keyword and a name
        ['relu', 'conv2']
        >>> select_layers(net, ["conv3"])
        Traceback (most recent call last):
        ...
        ValueError: unknown layer 'conv3'; did you mean 'conv2' or 'conv1'?
    """
    modules = list(model.named_modules())
    if layers is None:
        chosen = default_layers(model)
        if not chosen:
            raise ValueError(no_default_layers_message(model))
        return chosen
    if isinstance(layers, (str, type, nn.Module)) or (callable(layers) and not isinstance(layers, Iterable)):
        specs: list[LayerSpec] = [layers]  # a single spec
    elif isinstance(layers, Iterable):
        specs = list(layers)
    else:
        raise TypeError(
            f"layers= must be None (every module with parameters), a layer spec or a list of them; got "
            f"{type(layers).__name__}: {layers!r}. A spec is a module type (nn.Conv2d), a name ('features.0'), "
            "a glob on names ('classifier.*'), a module object, or a predicate (name, module) -> bool"
        )
    if not specs:
        raise ValueError("layers= is empty; pass None to watch the default layers")
    wanted: set[str] = set()
    for spec in specs:
        wanted.update(_match_one(spec, modules))
    return [(name, module) for name, module in modules if name in wanted]

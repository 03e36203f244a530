"""The tag vocabulary: every tag actviz writes, and :func:`step_items`, a step's results as tagged items.

A tag pattern names its variable parts in braces: ``{layer}`` is a module's tag name
(:func:`actviz.selection.layer_tag_names`: ``features.0`` as ``model.named_modules()`` names it, a long name
shortened to the part that tells layers apart, ``bert.encoder.layer.0.attention.self.query`` -> ``0.query``),
``{param}`` a parameter's (``features.0.weight``, ``0.query.weight``), ``{statistic}`` a statistic's name.
A per-layer statistic's tag ends ``{statistic}@{layer}``, in the last part of the tag: TensorBoard's Time Series
cuts a long card title before its last ``/`` and keeps that part whole. Modules that add tags to a
step (:mod:`actviz.capture.transformer_step`, :mod:`actviz.capture.probe`, :mod:`actviz.diagnosis.flow`, ...) build them
from the pattern constants below; :data:`ROWS` documents them, and the tables of README.md
(``readme=True`` rows) and docs/how-it-works.md are :func:`markdown_table` of it (a test checks).

In TensorBoard, actviz's scalars, histograms and images are under :data:`TENSORBOARD_PREFIX` + tag
(``~activations/features.0``; :func:`tensorboard_tag`), so that TensorBoard's default tab shows the
user's own tags (``loss``, ``train/loss``) first; the tag tables show those names.

:func:`step_items` turns a :class:`~actviz.common.results.StepResults` into ``(kind, tag, value)``
items, ``kind`` one of :data:`KINDS`: a :class:`~actviz.common.results.Summary` for ``"histogram"``,
a ``float`` for ``"scalar"``, a ``(1 or 3, H, W)`` ``uint8`` tensor for ``"image"`` (a heat map is a
:class:`~actviz.common.pixels.PaletteImage`: ``.rgb()`` is that tensor), markdown for ``"text"``.
:class:`~actviz.output.tensorboard.TensorBoardSink` maps them to TensorBoard values; a sink of
your own (``watch(sink=...)``, see :class:`actviz.output.sink.Sink`) can use it too.

Example:
    >>> from actviz.common.results import StepResults, Summary
    >>> results = StepResults(3, gradients={"fc": Summary(2, 0, 0, -4.0, 3.0, -1.0, 25.0, [1.0, 1.0])},
    ...                       scalars={"gradient_stats/norm@fc": 5.0})  # the statistic gradient_norms' value
    >>> [(kind, tag) for kind, tag, value in step_items(results)]
    [('histogram', 'gradients/fc'), ('scalar', 'gradient_stats/norm@fc')]
    >>> pattern_of("gradient_stats/norm@fc"), pattern_of("~gradient_stats/norm@fc"), pattern_of("my/own/tag")
    ('gradient_stats/norm@{layer}', 'gradient_stats/norm@{layer}', None)
    >>> tensorboard_tag("scalar", "gradient_stats/norm@fc"), tensorboard_tag("text", "alerts")
    ('~gradient_stats/norm@fc', 'alerts')
    >>> layer_statistic_of("~activation_stats/zero_fraction@0.query"), layer_statistic_of("alerts")
    (('activation_stats', 'zero_fraction', '0.query'), None)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .common.results import StepResults

__all__ = [
    "KINDS", "PATTERNS", "ROWS", "TENSORBOARD_PREFIX", "Item", "Row", "layer_statistic_of", "markdown_table",
    "pattern_of", "step_items", "tensorboard_tag",
]

#: What a tagged value is, in the order TensorBoard's tabs show them.
KINDS = ("image", "histogram", "scalar", "text")

#: What TensorBoard holds actviz's scalars, histograms and images under, before the tag. TensorBoard's default
#: tab, Time Series, shows those three kinds in one group per first part of a tag (``train`` of ``train/loss``),
#: groups in name order, and opens only the first two (TensorBoard 2.21, ``metrics_reducers.ts``). ``~`` sorts
#: after letters, digits and ``_``: the user's own groups come first, open; actviz's follow, closed. Texts are
#: not in Time Series and keep their tags.
TENSORBOARD_PREFIX = "~"
_TAB_KINDS = {"Images": "image", "Histograms": "histogram", "Scalars": "scalar", "Text": "text"}

FEATURE_MAPS = "feature_maps/{layer}"
ACTIVATIONS = "activations/{layer}"
GRADIENTS = "gradients/{layer}"
WEIGHTS = "weights/{param}"
WEIGHT_GRADS = "weight_grads/{param}"
ACTIVATION_STAT = "activation_stats/{statistic}@{layer}"  # the statistic is one of the rows' names
GRADIENT_STAT = "gradient_stats/{statistic}@{layer}"
WEIGHT_STAT = "weight_stats/{statistic}@{param}"  # a statistic of target "parameter"; no built-in has one
WEIGHT_GRAD_STAT = "weight_grad_stats/{statistic}@{param}"
GRAD_SCALE = "amp/grad_scale"
LOSS = "loss/backward_root"  # the value of the tensor a stats step's backward pass starts from
LAYERS = "layers"
ALERTS = "alerts"
FLOW = "flow/{statistic}"
PROBE_INPUT = "probe/input"
GRADCAM = "gradcam/{layer}"
ATTENTION_MAPS = "attention_maps/{layer}"
ATTENTION = "attention/{statistic}@{layer}"
RESIDUAL = "residual/{statistic}@{layer}"  # {layer}: a residual block (actviz.statistics.residual)
MOE = "moe/{statistic}@{layer}"  # {layer}: a router (actviz.transformers.moe)
UPDATE_RATIO = "update_ratio/{param}"
UPDATE_STAT = "update_stats/{statistic}@{param}"  # a statistic of target "parameter_update"
SPIKE_NORM = "spikes/gradient_norm/{layer}"
SPIKE_GLOBAL_NORM = "spikes/global_gradient_norm"
CLIP_NORMS = ("gradient_clipping/pre_clip_norm", "gradient_clipping/post_clip_norm", "gradient_clipping/coefficient")
CLIP_SHARE = "gradient_clipping/share@{layer}"
CLIP_TOP_LAYERS = "gradient_clipping/top_layers"
FP8_KEEP_IN_BF16 = ("fp8_readiness/keep_in_bf16", "fp8_readiness/keep_in_bf16_gradients")
LOGITS = ("logits/max", "logits/logsumexp", "logits/entropy")
GRADIENT_NOISE = ("gradient_noise/simple", "gradient_noise/grad_squared", "gradient_noise/trace_sigma")
NOISE_COUNTED_FRACTION = "gradient_noise/counted_fraction"

#: Written only from the first step where they are not zero (with ``shown``): a healthy run never shows
#: a card that stays at zero.
ONCE_NOT_ZERO = ("zero_fraction", "nonfinite")


@dataclass(frozen=True)
class Row:
    """One row of the tag tables: its tab, its tag patterns and what they are."""

    tab: str
    tags: tuple[str, ...]
    meaning: str
    readme: bool = False  # also in README.md's short table


def _stats(pattern: str, *names: str) -> tuple[str, ...]:
    return tuple(pattern.replace("{statistic}", name) for name in names)


#: Every tag actviz writes to a watched run, grouped by TensorBoard tab.
ROWS = (
    Row("Images", (FEATURE_MAPS,), "sample 0's channels as grayscale tiles, each normalised on its own (black = its "
        "min, white = its max); 3-D outputs `(N, C, L)` as one viridis heat map", readme=True),
    Row("Images", (FLOW,), "with `actviz.Options(flow_pictures=True)`: every layer over time, one row per layer: `gradient_norm`, `activation_std`, "
        "`zero_fraction` (and `update_ratio`), on image steps ([diagnosis](diagnosis.md))"),
    Row("Images", (PROBE_INPUT, GRADCAM), "with `actviz.Probe(batch)`: its sample 0, and with `gradcam=` Grad-CAM over it"),
    Row("Images", (ATTENTION_MAPS,), "with `actviz.Probe`: the probe's attention weights, one tile per head "
        "([transformers](transformers.md))"),
    Row("Histograms", (ACTIVATIONS,), "the layer's output", readme=True),
    Row("Histograms", (GRADIENTS,), "the gradient of the loss with respect to that output", readme=True),
    Row("Histograms", (WEIGHTS, WEIGHT_GRADS), "each parameter of the watched layers, and its gradient", readme=True),
    Row("Histograms", _stats(ATTENTION, "head_max_logit"), "each attention head's largest logit"),
    Row("Histograms", _stats(ATTENTION, "head_logit_bound"), "each attention head's largest log-sum-exp, a bound "
        "on its largest logit"),
    Row("Histograms", _stats(MOE, "expert_load"), "a router's tokens per expert ([mixture of experts](moe.md))"),
    Row("Scalars", _stats(ACTIVATION_STAT, "mean", "std", *ONCE_NOT_ZERO), "of the layer's output; `nonfinite` "
        "counts NaN and ±Inf, the others use the finite values", readme=True),
    Row("Scalars", _stats(GRADIENT_STAT, "norm", "nonfinite"),
        "L2 norm and NaN/Inf count of the output gradient", readme=True),
    Row("Scalars", _stats(GRADIENT_STAT, "kurtosis"), "with `\"gradient_kurtosis\"`: the output gradient's kurtosis"),
    Row("Scalars", _stats(WEIGHT_GRAD_STAT, "kurtosis"), "with `\"weight_grad_kurtosis\"`: the kurtosis of each "
        "parameter's gradient"),
    Row("Scalars", (LOSS,), "the value of the tensor each stats step's backward pass starts from: the loss of "
        "`loss.backward()` (of `scaler.scale(loss)`, divided by the scale); statistic `\"loss\"`, on unless you "
        "give your own `SummaryWriter`", readme=True),
    Row("Scalars", (GRAD_SCALE,), "the AMP loss scale, with `Options(grad_scaler=)`", readme=True),
    Row("Scalars", (UPDATE_RATIO,), "with `\"update_ratio\"`: ‖w_after − w_before‖ / ‖w_before‖"),
    Row("Scalars", _stats(UPDATE_STAT, "rms", "lost_fraction", "epsilon_fraction"), "with `\"update_rms\"`, "
        "`\"update_lost\"`, `\"adam_epsilon\"`: the RMS of the update the optimizer step applied, the fraction of "
        "elements with a gradient whose update rounding dropped, the fraction where Adam's ε exceeds √v̂ "
        "([diagnosis](diagnosis.md#the-optimizer))"),
    Row("Scalars", CLIP_NORMS, "the global gradient norm before clipping (what backward produced, complete after "
        "accumulation), after it (what the optimizer applies, as `weight_grads/*` show), and after / before "
        "(1: no clipping) ([diagnosis](diagnosis.md))"),
    Row("Scalars", (CLIP_SHARE,), "each layer's share of the squared global gradient norm before clipping"),
    Row("Scalars", (SPIKE_NORM, SPIKE_GLOBAL_NORM), "with `actviz.Spikes()`: the gradient norms before clipping of "
        "the steps before a spike"),
    Row("Scalars", _stats(ATTENTION, "max_logit", "entropy_min", "entropy_mean", "sink_fraction"),
        "attention health, with `\"attention\"` ([transformers](transformers.md))"),
    Row("Scalars", _stats(ATTENTION, "logit_bound", "logit_bound_low", "bound_head", "q_norm_max", "k_norm_max",
                          "qk_alignment"), "the largest attention logit of the whole batch bracketed by the kernel's "
        "log-sum-exp, and its head's split into ‖q‖, ‖k‖ and their alignment, with `\"attention\"` where SDPA runs a "
        "fused kernel ([transformers](transformers.md))"),
    Row("Scalars", _stats(RESIDUAL, "rms", "growth", "write_ratio", "effective_rank", "mean_cosine"),
        "with `\"residual\"`: each residual block's output RMS, its growth over the block's input, its write "
        "ratio ‖y − x‖ / ‖x‖, and the effective rank and mean cosine of its token rows ([transformers](transformers.md))"),
    Row("Scalars", LOGITS, "the output logits' size and entropy, with `\"logits\"`"),
    Row("Scalars", GRADIENT_NOISE, "with `\"gradient_noise\"`: the noise scale B_simple = tr(Σ) / ‖G‖², and its "
        "two estimates, from per-example gradient norms ([gradient noise](gradient-noise.md))"),
    Row("Scalars", (NOISE_COUNTED_FRACTION,), "with `\"gradient_noise\"` and `\"gradient_clipping\"`: the share of the "
        "squared gradient norm that the noise scale counts ([gradient noise](gradient-noise.md))"),
    Row("Scalars", _stats(MOE, "load_max_over_mean", "dead_experts", "router_entropy", "topk_margin"),
        "router health of a mixture of experts, with `\"moe\"` ([mixture of experts](moe.md))"),
    Row("Scalars", _stats(ACTIVATION_STAT, "max_abs", "kurtosis", "outlier_fraction", "headroom_bits"),
        "outliers of the layer's output, with `\"outliers\"`"),
    Row("Scalars", _stats(ACTIVATION_STAT, "dormant_fraction_0.025", "dormant_fraction_0.1", "dormant_count_0.025",
                          "dormant_count_0.1"),
        "with `\"dormant_units\"`: the fraction and count of τ-dormant units of each activation's output, τ = 0.025 "
        "and 0.1 ([diagnosis](diagnosis.md#dormant-units))"),
    Row("Scalars", _stats(ACTIVATION_STAT, "fp8_e4m3_underflow", "fp8_e5m2_underflow", "mx_e4m3_underflow",
                          "mx_e4m3_saturated", "mx_e5m2_underflow", "mx_e5m2_saturated"),
        "with `\"fp8_readiness\"`: the fractions of the layer's output that underflow or saturate in FP8 under "
        "per-tensor and MX block scaling ([transformers](transformers.md#fp8-and-mx-readiness))"),
    Row("Scalars", _stats(GRADIENT_STAT, "fp8_e4m3_underflow", "fp8_e5m2_underflow", "mx_e4m3_underflow",
                          "mx_e4m3_saturated", "mx_e5m2_underflow", "mx_e5m2_saturated"),
        "with `\"fp8_gradients\"`: the same of the output gradient"),
    Row("Text", (LAYERS,), "once: each watched layer's tag name, type, output shape and parameter count, and its "
        "module's full name where the tag name is shorter", readme=True),
    Row("Text", (ALERTS,), "health alerts, each at its step", readme=True),
    Row("Text", (CLIP_TOP_LAYERS,), "the 3 layers with the largest shares of the gradient norm before clipping"),
    Row("Text", (ACTIVATION_STAT.replace("{statistic}", "dormant_units"),), "with `\"dormant_units\"`: the indices of "
        "the layer's dormant units at each τ, on steps where it has some"),
    Row("Text", FP8_KEEP_IN_BF16, "with `\"fp8_readiness\"` (`\"fp8_gradients\"`): the layers whose outputs "
        "(output gradients) underflow over 1 % in e4m3 (e5m2) with per-tensor scaling"),
)

#: Every tag pattern of :data:`ROWS`, in order.
PATTERNS = tuple(tag for row in ROWS for tag in row.tags)

#: ``(kind, tag, value)``: see the module docstring.
Item = tuple[str, str, Any]

_MATCHERS = [(re.compile(re.sub(r"\\{\w+\\}", ".+", re.escape(pattern)) + "$"), pattern)
             for pattern in sorted(PATTERNS, key=lambda pattern: pattern.count("{"))]  # fixed names first


def pattern_of(tag: str) -> str | None:
    """The pattern of :data:`PATTERNS` that ``tag`` (or TensorBoard's name of it) is written under, or ``None``:
    not an actviz tag."""
    tag = tag.removeprefix(TENSORBOARD_PREFIX)
    return next((pattern for matcher, pattern in _MATCHERS if matcher.match(tag)), None)


def layer_statistic_of(tag: str) -> tuple[str, str, str] | None:
    """``(group, statistic, layer)`` of a per-layer statistic's tag (``group/statistic@layer``, TensorBoard's name
    or not), else ``None``."""
    group, _, rest = tag.removeprefix(TENSORBOARD_PREFIX).partition("/")
    statistic, at, layer = rest.partition("@")
    return (group, statistic, layer) if at and statistic and layer and "/" not in statistic else None


def tensorboard_tag(kind: str, tag: str) -> str:
    """The name TensorBoard holds ``tag`` of ``kind`` (one of :data:`KINDS`) under: :data:`TENSORBOARD_PREFIX` + tag,
    but for texts."""
    return tag if kind == "text" else TENSORBOARD_PREFIX + tag


def step_items(results: StepResults, shown: set[str] | None = None) -> Iterator[Item]:
    """Every ``(kind, tag, value)`` one step writes, in the order TensorBoard gets them.

    Args:
        results: The step.
        shown: The tags of :data:`ONCE_NOT_ZERO` statistics that were not zero at some step,
            updated here; such a tag is left out until then. ``None`` yields them all.
    """
    for layer, summary in results.activations.items():
        yield "histogram", ACTIVATIONS.format(layer=layer), summary
    for layer, summary in results.gradients.items():
        yield "histogram", GRADIENTS.format(layer=layer), summary
    for param, summary in results.weights.items():
        yield "histogram", WEIGHTS.format(param=param), summary
    for param, summary in results.weight_grads.items():
        yield "histogram", WEIGHT_GRADS.format(param=param), summary
    for tag, summary in results.histograms.items():  # full tags, e.g. attention/{layer}/head_max_logit
        yield "histogram", tag, summary
    yield from _scalars(shown, results.scalars)
    for tag, text in results.texts.items():
        yield "text", tag, text
    for layer, image in results.images.items():
        yield "image", FEATURE_MAPS.format(layer=layer), image
    for tag, image in results.pictures.items():  # full tags: probe/input, gradcam/{layer}, flow/...
        yield "image", tag, image


_LAYER_STATS = (ACTIVATION_STAT.split("/")[0], GRADIENT_STAT.split("/")[0])  # the tags ONCE_NOT_ZERO is about


def _scalars(shown: set[str] | None, scalars: dict[str, float]) -> Iterator[Item]:
    for tag, value in scalars.items():
        parts = layer_statistic_of(tag) if shown is not None else None
        if parts is not None and parts[1] in ONCE_NOT_ZERO and parts[0] in _LAYER_STATS:
            if value != 0:
                shown.add(tag)  # a chart that goes back to 0 shows it
            if tag not in shown:
                continue
        yield "scalar", tag, float(value)


def markdown_table(rows: tuple[Row, ...] = ROWS) -> str:
    """The Markdown table of ``rows``: tab (once per group), tags as TensorBoard shows them, meaning.

    A tag that differs from the row's first in its statistic alone is written as ``statistic@``.

    Example:
        >>> print(markdown_table((Row("Scalars", ("a/mean@{layer}", "a/std@{layer}"), "moments"),)))
        | TensorBoard tab | tag | what it is |
        |---|---|---|
        | Scalars | `~a/mean@{layer}`, `std@` | moments |
    """
    lines = ["| TensorBoard tab | tag | what it is |", "|---|---|---|"]
    tab = None
    for row in rows:
        shown = [tensorboard_tag(_TAB_KINDS[row.tab], tag) for tag in row.tags]
        first = layer_statistic_of(shown[0])
        tags = [f"`{shown[0]}`"] + [
            f"`{parts[1]}@`" if first and parts and (parts[0], parts[2]) == (first[0], first[2]) else f"`{tag}`"
            for tag, parts in ((tag, layer_statistic_of(tag)) for tag in shown[1:])
        ]
        shown_tab = f" {row.tab} " if row.tab != tab else " "
        lines.append(f"|{shown_tab}| {', '.join(tags)} | {row.meaning} |")
        tab = row.tab
    return "\n".join(lines)

"""The gradient noise scale B_simple of a logging step, from per-example gradient norms (``watch(gradient_noise=True)``).

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training" (arXiv:1812.06162), define the simple
noise scale ``B_simple = tr(Σ) / |G|²``: ``G`` is the true gradient and ``Σ`` the covariance of one example's
gradient. Their appendix A estimates both without bias from the squared norms of gradients taken over two batch
sizes; here the sizes are 1 and the batch ``B``, as Gray et al., "Normalization Layer Per-Example Gradients are
Sufficient to Predict Gradient Noise Scale in Transformers" (NeurIPS 2024), take them::

    |G_1|² = mean_b ‖∇ℓ_b‖²           |G_B|² = ‖mean_b ∇ℓ_b‖²
    |G|²   ≈ (B·|G_B|² − |G_1|²) / (B − 1)        tr(Σ) ≈ (|G_1|² − |G_B|²) / (1 − 1/B)

A step writes ``gradient_noise/simple`` (their ratio), ``/grad_squared`` (``|G|²``), ``/trace_sigma`` (``tr(Σ)``)
and ``/counted_fraction`` (the counted share of the squared gradient norm, :func:`~.noise_layers.counted_fraction`).

**Which parameters count.** Those that require grad of each watched layer :func:`~.noise_layers.layer_kind`
counts (``nn.Linear``, the norms, Hugging Face's ``Conv1D`` and ``*RMSNorm``), in its first call of the forward;
a tied embedding through its head alone. Others (convolutions, embeddings, BatchNorm, whose batch statistics tie
the examples together) are not in the sums. A layer run without grad (``checkpoint``) or whose input's first
dimension is not the step's batch size ``B`` (that of the first counted layer) is left out.

**Per-example norms, no per-example gradient.** A layer's forward hook keeps its input ``x``, the tensor autograd
keeps for the layer's own backward anyway, until the pre-hook on its output's gradient ``g`` (the step's existing
hooks, :mod:`actviz.capture.output_gradients`) takes it and drops it. The first dimension is the batch (the
second in a time-first model, :class:`NoiseRun`); every other dimension but the last is a sequence ``T``
(flattened). Example ``b``'s share of a ``Linear``'s gradient is
``c_b = Σ_t g_bt x_btᵀ`` (and ``Σ_t g_bt`` for the bias), and ``‖c_b‖² = sum((G_b G_bᵀ) ⊙ (X_b X_bᵀ + 1))``:
two ``T × T`` Gram matrices per example, ``+ 1`` for the bias, or each example's ``c_b`` made, where that costs
less (:func:`linear_route`: intermediates never larger than the layer). The batch's ``‖Σ_b c_b‖²`` is the squared
norm of ``gᵀx`` (one matmul of the layer's own weight-gradient size), or, where it costs fewer operations, the
same Gram sum over all ``B·T`` rows, whose diagonal blocks give the per-example norms in the same ops. A norm layer's
share is ``Σ_t g_bt ⊙ x̂_bt`` (``x̂`` the normalised input, computed again from ``x``) and ``Σ_t g_bt``: vectors of
the layer's width. Everything runs on the device, in float32 at least, with no sync; each layer leaves a
``(B,)`` tensor and a 0-dim one, which go to the host in the step's one copy, and :func:`noise_scale` makes the
three values on the writer thread.

**Scale.** The backward gives ``c_b = s·∇ℓ_b`` with ``s = 1/B`` for a mean-reduced loss, 1 for a sum.
``B_simple`` is the same for any ``s``; ``grad_squared`` and ``trace_sigma`` assume a mean-reduced loss. With a
``grad_scaler``, they are divided by the loss scale squared. Under DDP the batch is rank 0's own (per-rank)
batch, before the all-reduce; with gradient accumulation, the step's first micro-batch.

Example:
    >>> layer = torch.nn.Linear(3, 2)
    >>> x, g = torch.randn(4, 3), torch.randn(4, 2)
    >>> per_example, batch = squared_norms(layer, x, g)
    >>> contributions = g[:, :, None] * x[:, None, :]  # each example's weight-gradient share, for the check
    >>> torch.allclose(per_example, contributions.square().sum((1, 2)) + g.square().sum(1))
    True
    >>> values = noise_scale([1.0, 1.0, 1.0, 1.0], 16.0)  # four equal shares c, ‖4c‖² = 16: no noise
    >>> values["gradient_noise/trace_sigma"], values["gradient_noise/simple"]
    (0.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..common.distributed_types import is_dtensor
from ..common.safe_warnings import warn_once
from ..tags import CLIP_NORMS, GRAD_SCALE, GRADIENT_NOISE, NOISE_COUNTED_FRACTION
from .noise_layers import counted_fraction, layer_kind, rms_epsilon

__all__ = ["COUNTED", "FAILED", "GradientNoise", "NoiseRun", "linear_route", "noise_scale", "squared_norms"]

_NORMS = (nn.LayerNorm, nn.RMSNorm)
COUNTED = (nn.Linear, *_NORMS)  #: PyTorch's layer types whose parameters count (and HF's: :func:`layer_kind`)
SIMPLE, GRAD_SQUARED, TRACE_SIGMA = GRADIENT_NOISE
#: The name a failure is reported under (the watcher turns the option off for its later steps).
FAILED = "(gradient_noise)"


def _trainable(parameter: Any) -> bool:
    return isinstance(parameter, torch.Tensor) and parameter.requires_grad


def counts(module: nn.Module) -> tuple[bool, bool]:
    """Whether ``module``'s weight and its bias count (see the module docstring)."""
    if layer_kind(module) is None:
        return False, False
    return _trainable(getattr(module, "weight", None)), _trainable(getattr(module, "bias", None))


@torch.no_grad()
def squared_norms(module: nn.Module, x: torch.Tensor | None, g: torch.Tensor,
                  batch_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's squared norm of its share of ``module``'s parameter gradient, and the batch's.

    Args:
        module: An ``nn.Linear``, ``nn.LayerNorm`` or ``nn.RMSNorm``; its parameters that require grad count.
        x: The layer's input, ``(B, ..., features)``; ``None`` where the weight does not count.
        g: The gradient with respect to its output, as the backward gives it: the shape of the output.
        batch_dim: The dimension of ``x`` and ``g`` that holds the examples (1 for a time-first ``(T, B, ...)``).

    Returns:
        ``(B,)``: ``‖c_b‖²`` summed over the counted parameters, and a 0-dim tensor: ``‖Σ_b c_b‖²``, both in
        float32 at least, on ``g``'s device.
    """
    weight, bias = counts(module)
    weight = weight and x is not None
    wide = g.dtype == torch.float64 or (x is not None and x.dtype == torch.float64)
    dtype = torch.float64 if wide else torch.float32  # float32 at least, one dtype for both (autocast mixes them)
    if batch_dim:  # time-first: the examples to the front (a view; reshape copies only where it must)
        g = g.movedim(batch_dim, 0)
        x = x.movedim(batch_dim, 0) if x is not None else None
    batch = g.shape[0]
    kind = layer_kind(module)
    norm = kind != "linear"
    width = g.shape[-1] if not norm else math.prod(getattr(module, "normalized_shape", module.weight.shape))
    g = g.reshape(batch, -1, width).to(dtype)
    if weight:
        assert x is not None
        x = x.reshape(batch, -1, width if norm else x.shape[-1]).to(dtype)
    if norm:
        return _norm_layer(module, kind == "layer_norm", x, g, weight, bias)
    return _linear(x, g, weight, bias)


#: The fewest elements a route's intermediate tensors may hold, whatever the layer's size (16 MB in float32).
MEMORY_FLOOR = 1 << 22


def linear_route(batch: int, steps: int, d_in: int, d_out: int) -> tuple[str, int]:
    """How :func:`squared_norms` takes a Linear's norms, and how many examples at a time.

    The fewest operations among the routes whose intermediates fit the layer's own size (the larger of its
    weight and its input, or :data:`MEMORY_FLOOR` elements); where none fits, the route of least memory per
    example, as many examples at a time as fit. The routes, with their intermediate elements and operations
    (``B`` examples of ``T`` positions, ``in``/``out`` features; the last two add ``B·T·in·out`` for the batch's
    ``gᵀx``): ``"batch gram"``, the whole batch's two ``B·T × B·T`` Gram matrices (``2(BT)²``,
    ``(BT)²(in+out)``); ``"gram"``, two ``T × T`` Gram matrices per example (``2BT²``, ``BT²(in+out)``);
    ``"weight"``, each example's weight-gradient share (``B·in·out``, ``BT·in·out``).

    Example:
        >>> linear_route(16, 4, 8, 16)  # short sequences: the Gram matrices
        ('gram', 16)
        >>> linear_route(2, 8192, 16, 16)  # long ones: each example's 16 × 16 weight gradient, not 8192²
        ('weight', 2)
        >>> linear_route(32, 1024, 64, 4096)  # neither fits whole: 15 examples' weight gradients at a time
        ('weight', 15)
    """
    rows = batch * steps
    weight_size = max(d_in, 1) * d_out + d_out  # a frozen weight: the bias alone
    budget = max(weight_size, rows * d_in, MEMORY_FLOOR)
    routes = {  # route: (operations, intermediate elements per example, for the whole batch)
        "batch gram": (rows * rows * (d_in + d_out), 2 * rows * rows, 2 * rows * rows),
        "gram": (rows * steps * (d_in + d_out) + rows * d_in * d_out, 2 * steps * steps, 2 * batch * steps * steps),
        "weight": (2 * rows * d_in * d_out, weight_size, batch * weight_size),
    }
    fitting = [(ops, name) for name, (ops, _, memory) in routes.items() if memory <= budget]
    if fitting:
        return min(fitting)[1], batch
    each, name = min((routes[name][1], name) for name in ("gram", "weight"))
    return name, max(1, budget // each)


def _linear(x: torch.Tensor | None, g: torch.Tensor, weight: bool, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, steps, d_out = g.shape
    d_in = x.shape[-1] if x is not None and weight else 0
    route, chunk = linear_route(batch, steps, d_in, d_out)
    if route == "batch gram":  # the whole batch's Gram costs less than gᵀx
        rows_g = g.reshape(batch * steps, d_out)
        products = torch.mm(rows_g, rows_g.T)
        if weight:
            assert x is not None
            rows_x = x.reshape(batch * steps, d_in)
            grams = torch.mm(rows_x, rows_x.T)
            products.mul_(grams.add_(1.0) if bias else grams)
        blocks = products.view(batch, steps, batch, steps).diagonal(dim1=0, dim2=2)  # (T, T, B): same example
        return blocks.sum((0, 1)), products.sum()
    each = _gram_norms if route == "gram" else _weight_norms
    parts = [each(x[start:start + chunk] if x is not None and weight else None, g[start:start + chunk], bias)
             for start in range(0, batch, chunk)]
    per_example = parts[0][0] if len(parts) == 1 else torch.cat([part[0] for part in parts])
    total = None
    if weight:
        assert x is not None
        summed = torch.mm(g.reshape(-1, d_out).T, x.reshape(-1, d_in)).reshape(-1)
        total = torch.dot(summed, summed)
    if bias:
        summed = g.sum((0, 1))
        total = torch.dot(summed, summed) if total is None else total.add_(torch.dot(summed, summed))
    assert total is not None
    return per_example, total


def _gram_norms(x: torch.Tensor | None, g: torch.Tensor, bias: bool) -> tuple[torch.Tensor]:
    """``sum((G_b G_bᵀ) ⊙ (X_b X_bᵀ + 1))`` of each example: two ``T × T`` Gram matrices per example."""
    products = torch.bmm(g, g.transpose(1, 2))  # (B, T, T)
    if x is not None:
        grams = torch.bmm(x, x.transpose(1, 2))
        products.mul_(grams.add_(1.0) if bias else grams)
    return (products.sum((1, 2)),)


def _weight_norms(x: torch.Tensor | None, g: torch.Tensor, bias: bool) -> tuple[torch.Tensor]:
    """``‖G_bᵀ X_b‖² + ‖Σ_t g_bt‖²`` of each example: its weight-gradient share, ``out × in``, made."""
    per_example = None
    if x is not None:
        shares = torch.bmm(g.transpose(1, 2), x)  # (B, out, in)
        per_example = shares.square_().sum((1, 2))
    if bias:
        sums = g.sum(1)
        norms = sums.square_().sum(1)
        per_example = norms if per_example is None else per_example.add_(norms)
    assert per_example is not None
    return (per_example,)


def _norm_layer(module: nn.Module, layer_norm: bool, x: torch.Tensor | None, g: torch.Tensor, weight: bool,
                bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    parts = []
    if weight:
        assert x is not None
        width = (x.shape[-1],)
        normalised = (F.layer_norm(x, width, eps=module.eps) if layer_norm
                      else F.rms_norm(x, width, eps=rms_epsilon(module)))
        parts.append(g * normalised)
    if bias:
        parts.append(g)
    shares = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).sum(1)  # (B, width or 2 width)
    summed = shares.sum(0)
    return (shares * shares).sum(-1), torch.dot(summed, summed)


def noise_scale(per_example: Sequence[float], batch: float, loss_scale: float = 1.0) -> dict[str, float]:
    """The three values from the summed squared norms of :func:`squared_norms` (a mean-reduced loss).

    Args:
        per_example: ``‖c_b‖²`` of each example ``b``, summed over the counted parameters.
        batch: ``‖Σ_b c_b‖²``, summed likewise.
        loss_scale: The AMP loss scale the gradients carry.

    Returns:
        ``{tag: value}``; ``gradient_noise/simple`` is left out where the ``|G|²`` estimate is 0.
    """
    size = len(per_example)
    squared_scale = loss_scale * loss_scale
    mean_one = size * math.fsum(per_example) / squared_scale  # mean_b ‖∇ℓ_b‖², with ∇ℓ_b = B·c_b
    mean_batch = batch / squared_scale  # ‖mean_b ∇ℓ_b‖² = ‖Σ_b c_b‖²
    grad_squared = (size * mean_batch - mean_one) / (size - 1)
    trace_sigma = (mean_one - mean_batch) / (1 - 1 / size)
    values = {GRAD_SQUARED: grad_squared, TRACE_SIGMA: trace_sigma}
    if grad_squared != 0:
        values[SIMPLE] = trace_sigma / grad_squared
    return {tag: values[tag] for tag in GRADIENT_NOISE if tag in values}


def finish_on_host(results: Any, carried: list[torch.Tensor]) -> None:
    """The writer thread's half: sum the layers' norms (``carried``: per-example, batch, ...) into the step's scalars."""
    per_example = torch.stack(carried[0::2]).double().sum(0)
    batch = sum(float(norm) for norm in carried[1::2])
    scale = results.scalars.get(GRAD_SCALE, 1.0)
    results.scalars.update(noise_scale(per_example.tolist(), batch, scale))
    if (fraction := counted_fraction(batch, results.scalars.get(CLIP_NORMS[0]), scale)) is not None:
        results.scalars[NOISE_COUNTED_FRACTION] = fraction


#: What a step that counted nothing says, when no layer gave a more precise cause.
NO_LAYER = ("no watched nn.Linear, nn.LayerNorm or nn.RMSNorm with a trainable parameter ran with grad "
            "(convolutions, embeddings and the other layers do not count)")
_TIME_FIRST = 1  # the batch dimension of a time-first model's sequences

@dataclass
class NoiseRun:
    """What a watcher's steps share: the batch dimension of its model's sequences, and the causes said.
    ``batch_dim`` is 1 where the model's layers with a ``batch_first`` attribute all have it ``False``
    (PyTorch's default for nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention and nn.Transformer*), 0 where they
    all have it ``True`` or there are none, and ``None`` where both are found: the batch dimension of a
    sequence cannot be told, and nothing is counted.

    Example:
        >>> NoiseRun.of(nn.Sequential(nn.Linear(2, 2))).batch_dim, NoiseRun.of(nn.LSTM(2, 2)).batch_dim
        (0, 1)
        >>> print(NoiseRun.of(nn.ModuleList([nn.LSTM(2, 2), nn.GRU(2, 2, batch_first=True)])).batch_dim)
        None
    """

    batch_dim: int | None = 0
    warned: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: nn.Module) -> NoiseRun:
        layouts = {time_first(module) for module in model.modules() if "batch_first" in vars(module)}
        return cls(None if len(layouts) > 1 else _TIME_FIRST if True in layouts else 0)


def time_first(module: nn.Module) -> bool:
    """Whether ``module`` takes ``(T, B, ...)`` inputs: its ``batch_first`` is ``False``."""
    return vars(module).get("batch_first") is False


class GradientNoise:
    """One logging step's device half: inputs kept from the forward hooks, squared norms from the gradient hooks.

    Args:
        add_host_work: The step's :meth:`PendingStep.add_host_work <actviz.output.pending_step.PendingStep.add_host_work>`.
        on_error: Called with :data:`FAILED` and the exception when a hook's part fails; the step then takes no more.
        run: What the watcher's steps share (:class:`NoiseRun`): the batch dimension, the causes warned about.

    Example:
        >>> carried = []
        >>> noise = GradientNoise(lambda work, *tensors: carried.extend(tensors), print)
        >>> layer = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> y = layer(x)
        >>> noise.take_input("fc", layer, (x,), y)
        >>> noise.take_gradient("fc", torch.ones(4, 2))
        >>> noise.hand_over()
        >>> [tuple(tensor.shape) for tensor in carried]
        [(4,), ()]
    """

    def __init__(self, add_host_work: Callable[..., None], on_error: Callable[[str, BaseException], None],
                 run: NoiseRun | None = None) -> None:
        self._add_host_work = add_host_work
        self._on_error = on_error
        self._run = run or NoiseRun()
        self._inputs: dict[str, tuple[nn.Module, torch.Tensor | None, int]] = {}
        self._carried: list[torch.Tensor] = []
        self._batch: int | None = None  # B, set by the first layer counted or a time-first layer's input
        self._failed = False
        self._skipped: str | None = None  # why the first layer left out was left out

    def take_input(self, tag: str, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        """A counted layer's forward hook: keep its input (for the weight's share) until its output's gradient comes.

        A time-first layer's input tells the step's batch size (its dimension 1).
        """
        if self._failed or not inputs or not torch.is_grad_enabled():
            return
        x = inputs[0]
        weight, bias = counts(module)
        if not (weight or bias):
            if time_first(module) and self._batch is None and isinstance(x, torch.Tensor) and x.dim() == 3:
                self._batch = x.shape[1]
            return
        skipped = self._left_out(x, output)
        if skipped is not None:
            self._skipped = self._skipped or skipped
            return
        dim = 0 if x.dim() == 2 else self._run.batch_dim
        assert dim is not None
        self._batch = x.shape[dim]
        self._inputs[tag] = (module, x.detach() if weight else None, dim)  # autograd keeps it for the weight anyway

    def _left_out(self, x: Any, output: torch.Tensor) -> str | None:
        """Why a counted layer's input does not count, or ``None``."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.is_nested or is_dtensor(x):
            return "the counted layers' inputs are not plain floating-point tensors"
        if x.dim() < 2:
            return "1-D inputs (a single example, no batch dimension)"
        if x.dim() == 2:
            dim = 0
            if self._run.batch_dim == _TIME_FIRST and self._batch is None:
                return ("a 2-D input in a time-first model before any layer told the batch size: "
                        "its rows may be time steps × examples")
        elif self._run.batch_dim is None:
            return ("the batch dimension cannot be told: the model has layers with batch_first=True and "
                    "others with batch_first=False")
        else:
            dim = self._run.batch_dim
        size = x.shape[dim]
        if size < 2:
            return f"a batch of {size} example{'s' * (size != 1)} (the noise scale compares two or more)"
        if output.dim() <= dim or output.shape[dim] != size or size != (self._batch or size):
            return f"inputs whose dimension {dim} is not the step's batch size"
        return None

    def take_gradient(self, tag: str, grad: torch.Tensor) -> None:
        """The gradient with respect to the output of a layer whose input was kept: its squared norms, input dropped."""
        entry = self._inputs.pop(tag, None)
        if entry is None:
            return
        module, x, dim = entry
        try:
            self._carried.extend(squared_norms(module, x, grad, batch_dim=dim))
        except Exception as error:  # noqa: BLE001 - a hook must never stop training
            self._failed = True
            self._inputs.clear()
            self._on_error(FAILED, error)

    def hand_over(self, backward_seen: bool = False) -> None:
        """The step is over: drop the inputs still kept, and carry the norms to the writer thread.

        A step whose backward came (``backward_seen``) and counted nothing warns once per cause.
        """
        self._inputs.clear()
        if self._carried:
            self._add_host_work(finish_on_host, *self._carried)
            self._carried = []
        elif backward_seen and not self._failed:
            cause = self._skipped or NO_LAYER
            warn_once(self._run.warned, cause, f"actviz: the gradient_noise statistic counted nothing in this step: "
                      f"{cause}; no gradient_noise/ values are written (warned once)", RuntimeWarning, stacklevel=3)

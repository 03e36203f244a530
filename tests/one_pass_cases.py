"""Cases for the one-pass ops (``torch.ops.actviz.summarize``, ``torch.ops.actviz.logit_rows``) and their numbers
worked out in float64 by hand.

Used by tests/test_one_pass.py in its own process for the eager body, and, run as a script with
``TRITON_INTERPRET=1``, for the Triton body on CPU tensors: ``python tests/one_pass_cases.py [GROUP ...]`` (:data:`GROUPS`) prints one line
per case that does not match and exits 1 if any, 2 if the Triton body was not the one that ran.
"""

from __future__ import annotations

import math
import os
import sys

import torch

OUTLIER_THRESHOLD = 6.0


def cases() -> list[tuple[str, torch.Tensor, list[int], list[int]]]:
    """``(name, values, sizes, sample strides)``: ``values`` is split into tensors of ``sizes``."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    special = randn(5000) * 4
    special[[3, 10, 4999]] = torch.tensor([math.nan, math.inf, -math.inf])
    special[100:140] = 0.0
    all_nan = torch.full((70,), math.nan)
    denormal = torch.tensor([1e-40, -3e-42, 0.0, 2.5, 1e-45] * 10, dtype=torch.float32)
    offset = randn(20_000).double() * 1e-3 + 1e8  # a large offset: the variance must not cancel
    first_not_finite = randn(3000)
    first_not_finite[0] = math.nan
    found = [
        ("float32 with NaN, ±Inf and zeros", special, [5000], [7]),
        ("all NaN", all_nan, [70], [1]),
        ("denormals", denormal, [50], [3]),
        ("large offset, float64", offset, [20_000], [11]),
        ("first element NaN", first_not_finite, [3000], [1]),
        ("one element", torch.tensor([-2.5]), [1], [1]),
        ("bfloat16", (randn(40_000) * 10).to(torch.bfloat16), [40_000], [13]),
        ("float16 near its max", (randn(9000) * 3e4).clamp(-65000, 65000).to(torch.float16), [9000], [17]),
        ("several tensors of several tiles", randn(3 + 5000 + 70_000) * 8, [3, 5000, 70_000], [1, 7, 31]),
        ("an outlier-heavy tail", torch.cat([randn(30_000), torch.full((5,), 300.0)]), [30_005], [19]),
    ]
    strided = (randn(6000) * 2)[::2]  # not contiguous: the eager body takes it
    found.append(("not contiguous", strided, [3000], [5]))
    return found


def expected(values: torch.Tensor, sizes: list[int], strides: list[int]) -> list[list[float]]:
    """Per segment: the 10 numbers of a row with outliers, then its sample, all by float64 ops."""
    rows = []
    start = 0
    for size, stride in zip(sizes, strides):
        x = values[start : start + size].double()
        start += size
        finite = torch.isfinite(x)
        z = torch.where(finite, x, torch.zeros_like(x))
        mean = z.sum().item() / size
        centred = z - mean
        magnitude = x.abs()
        not_nan = magnitude[~torch.isnan(x)]
        rows.append([
            float((x != 0).sum()), float((z != 0).sum()), mean, (centred**2).sum().item() / size,
            x[finite].min().item() if finite.any() else math.inf, x[finite].max().item() if finite.any() else -math.inf,
            not_nan.max().item() if not_nan.numel() else 0.0, float((magnitude >= OUTLIER_THRESHOLD).sum()),
            (centred**2).sum().item(), (centred**4).sum().item(), *x[::stride].tolist(),
        ])
    return rows


def _close(found: float, wanted: float, relative: float, absolute: float) -> bool:
    if math.isnan(wanted) or math.isnan(found):
        return math.isnan(wanted) and math.isnan(found)
    if math.isinf(wanted) or math.isinf(found):
        return found == wanted
    return abs(found - wanted) <= absolute + relative * abs(wanted)


def mismatches(name: str, values: torch.Tensor, sizes: list[int], strides: list[int], outliers: bool) -> list[str]:
    """What the op gives that the float64 numbers do not, as lines; empty where all match."""
    import actviz.summaries.one_pass  # noqa: F401 - defines the op

    tensors = list(values.split(sizes)) if len(sizes) > 1 else [values]  # several: each read where it lies
    out = torch.ops.actviz.summarize.default(tensors, strides, outliers).tolist()
    width = 10 if outliers else 6
    wanted_rows = expected(values, sizes, strides)
    found_rows, samples_at = [], len(sizes) * width
    for index, (size, stride) in enumerate(zip(sizes, strides)):
        count = -(-size // stride)
        found_rows.append(out[index * width : (index + 1) * width] + out[samples_at : samples_at + count])
        samples_at += count
    problems = []
    if samples_at != len(out):
        problems.append(f"{name}: {len(out)} numbers, expected {samples_at}")
    fields = ["nonzero", "finite_nonzero", "mean", "variance", "min", "max", "max_abs", "outliers", "squares", "fourths"]
    for index, (found, wanted) in enumerate(zip(found_rows, wanted_rows)):
        wanted = wanted[:width] + wanted[10:]
        names = fields[:width] + [f"sample[{i}]" for i in range(len(wanted) - width)]
        scale = max(1.0, abs(wanted[2]))  # the mean's size: sums about it keep relative precision near it
        for field, got, want in zip(names, found, wanted):
            relative, absolute = 0.0, 0.0  # counts, bounds and the sample: exact
            if field in ("mean",):
                relative, absolute = 1e-12, 1e-12 * scale
            elif field in ("variance", "squares", "fourths"):
                relative, absolute = 1e-6, 1e-9
            if not _close(got, want, relative, absolute):
                problems.append(f"{name}: segment {index} {field} {got!r}, expected {want!r}")
    return problems


def unit_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, list[float], float]]:
    """``(name, shaped output, its elements in memory order, units, the fraction by hand)``."""
    generator = torch.Generator().manual_seed(2)
    relu = torch.randn(2, 6, 5, 5, generator=generator).relu()
    relu[:, [1, 4]] = 0.0
    relu[:, 2] = 0.0
    relu[1, 2, 0, 0] = math.nan  # a channel of zeros and one NaN is not dead (its amax is not 0)
    big = torch.randn(8, 64, 32, 32, generator=generator).relu()  # 16 tiles
    big[:, :10] = 0.0
    sequence = torch.randn(4, 8, 10, generator=generator).relu()
    sequence[:, [0, 3, 7]] = 0.0
    last = relu.contiguous(memory_format=torch.channels_last)
    rows = torch.randn(3, 300, 200, generator=generator).relu()  # 6 tiles of fewer rows than channels: a bin a row
    rows[:, [0, 5, 163, 164, 299]] = 0.0
    rows[2, 164, 199] = 1.0
    wide_last = torch.randn(8, 70, 16, 16, generator=generator).relu().contiguous(memory_format=torch.channels_last)
    wide_last[:, [3, 69]] = 0.0  # 5 tiles, each starting mid-row of 70 channels
    beyond = torch.randn(2, 5000, 1, generator=generator).relu()  # 5,000 channels of 1: past the histogram, eager
    beyond[:, :7] = 0.0
    beyond_last = torch.randn(1, 5000, 4, 4, generator=generator).relu().contiguous(memory_format=torch.channels_last)
    beyond_last[:, 4990:] = 0.0  # 5,000 channels last: a bin per channel would be past the histogram, eager
    tanh = torch.tanh(torch.randn(50_000, generator=generator) * 3)
    sigmoid = torch.sigmoid(torch.randn(3000, generator=generator) * 4)
    sigmoid[5] = math.nan

    def dead(x: torch.Tensor) -> float:
        dims = [d for d in range(x.dim()) if d != 1]
        return float(((x != 0).sum(dim=dims) == 0).double().mean())

    return [
        ("dead channels", relu, relu.reshape(-1), [1, 6, 25, 0], dead(relu)),
        ("dead channels, channels last", last, last.permute(0, 2, 3, 1).reshape(-1), [1, 6, 25, 1], dead(relu)),
        ("dead channels of a sequence", sequence, sequence.reshape(-1), [1, 8, 10, 0], dead(sequence)),
        ("dead channels over 16 tiles", big, big.reshape(-1), [1, 64, 1024, 0], dead(big)),
        ("dead channels, a bin per row of a tile", rows, rows.reshape(-1), [1, 300, 200, 0], dead(rows)),
        ("dead channels, channels last over 5 tiles", wide_last, wide_last.permute(0, 2, 3, 1).reshape(-1),
         [1, 70, 256, 1], dead(wide_last)),
        ("dead channels past the kernels' histogram", beyond, beyond.reshape(-1), [1, 5000, 1, 0], dead(beyond)),
        ("dead channels past the kernels' histogram, channels last", beyond_last,
         beyond_last.permute(0, 2, 3, 1).reshape(-1), [1, 5000, 16, 1], dead(beyond_last)),
        ("tanh saturation", tanh, tanh, [2, 0.0, 0.97], float((tanh.double().abs() > 0.97).double().mean())),
        ("sigmoid saturation", sigmoid, sigmoid, [2, 0.5, 0.47],
         float(((sigmoid.double() - 0.5).abs() > 0.47).double().mean())),
    ]


def unit_mismatches(name: str, flat: torch.Tensor, units: list[float], wanted: float) -> list[str]:
    """The row's last number (the unit fraction) against the fraction by hand; and the header unchanged by it."""
    import actviz.summaries.one_pass  # noqa: F401 - defines the op

    with_units = torch.ops.actviz.summarize.default([flat], [7], True, units)
    without = torch.ops.actviz.summarize.default([flat], [7], True)
    problems = []
    if abs(with_units[10].item() - wanted) > 1e-9:
        problems.append(f"{name}: unit fraction {with_units[10].item()!r}, expected {wanted!r}")
    if not torch.equal(with_units[:10].nan_to_num(), without[:10].nan_to_num()) or not torch.equal(
            with_units[11:].nan_to_num(), without[10:].nan_to_num()):
        problems.append(f"{name}: the rest of the row or the sample changed with units")
    return problems


def strength_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, list[int]]]:
    """``(name, shaped output, its elements in memory order, channel layout)`` for the channel strengths: each
    layout branch of the kernel (long channels, short channels, channels last) and a channel over two tiles."""
    generator = torch.Generator().manual_seed(3)
    long = torch.randn(3, 70, 30, 30, generator=generator) * 3  # 900 per channel: a sum per channel and block
    long[0, 1, 0, 2], long[0, 2, 1, 1], long[0, 3, 0, 0] = math.nan, math.inf, -math.inf
    short = torch.randn(4, 100, 5, 5, generator=generator)  # 25 per channel: an add per element
    huge = (torch.randn(2, 3, 190, 180, generator=generator) * 2).to(torch.float16)  # 34,200 a channel: over two tiles
    last = (torch.randn(2, 80, 40, 40, generator=generator) * 4).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    last_tiles = (torch.randn(2, 300, 20, 20, generator=generator) * 3).contiguous(memory_format=torch.channels_last)
    last_tiles[0, 7, 3, 4] = math.inf  # sample 0 over two tiles of 300 channels
    eight = torch.randn(2, 70, 5, 5, generator=generator).to(torch.float8_e4m3fn)  # the eager body reads it as float32
    return [
        ("channel strengths, long channels with NaN and ±Inf", long, long.reshape(-1), [70, 900, 0]),
        ("channel strengths, float8", eight, eight.reshape(-1), [70, 25, 0]),
        ("channel strengths, short channels", short, short.reshape(-1), [100, 25, 0]),
        ("channel strengths, float16 over two tiles", huge, huge.reshape(-1), [3, 190 * 180, 0]),
        ("channel strengths, bfloat16 channels last", last, last.permute(0, 2, 3, 1).reshape(-1), [80, 1600, 1]),
        ("channel strengths, channels last over two tiles", last_tiles, last_tiles.permute(0, 2, 3, 1).reshape(-1),
         [300, 400, 1]),
    ]


def strength_mismatches(name: str, shaped: torch.Tensor, flat: torch.Tensor, channels: list[int]) -> list[str]:
    """The op's channel strengths against sample 0's mean ``|x|`` per channel by float64 (NaN and ±Inf as 0); and
    the row and sample unchanged by them."""
    import actviz.summaries.one_pass  # noqa: F401 - defines the op

    with_strengths = torch.ops.actviz.summarize.default([flat], [7], False, [], channels)
    without = torch.ops.actviz.summarize.default([flat], [7], False)
    magnitudes = shaped[0].cpu().double().abs()
    wanted = torch.where(torch.isfinite(magnitudes), magnitudes, 0.0).mean(dim=(1, 2))
    found = with_strengths[without.numel():].cpu()
    problems = []
    if found.shape != wanted.shape or not torch.allclose(found, wanted, rtol=1e-12, atol=0.0):
        problems.append(f"{name}: strengths off by {(found - wanted).abs().max().item() if found.shape == wanted.shape else found.shape}")
    if not torch.equal(with_strengths[: without.numel()].cpu().nan_to_num(), without.cpu().nan_to_num()):
        problems.append(f"{name}: the row or the sample changed with the strengths")
    return problems


def logit_cases() -> list[tuple[str, torch.Tensor]]:
    """``(name, (n, classes) logits)`` for ``torch.ops.actviz.logit_rows``."""
    generator = torch.Generator().manual_seed(1)
    masked = torch.randn(6, 3000, generator=generator) * 4
    masked[:, 1000:] = -math.inf  # a causal or padding mask's classes
    return [
        ("a vocabulary's rows", torch.randn(5, 5000, generator=generator) * 5),
        ("masked classes", masked),
        ("large logits", torch.randn(3, 2500, generator=generator) + 1e4),
        ("bfloat16", (torch.randn(4, 1500, generator=generator) * 8).to(torch.bfloat16)),
        ("three classes", torch.tensor([[1.0, 2.0, 3.0]])),
    ]


def logit_mismatches(name: str, logits: torch.Tensor) -> list[str]:
    """What the op gives that float64 does not: each row's max, log Z and Σ p log p."""
    import actviz.statistics.logit_rows  # noqa: F401 - defines the op

    found = torch.ops.actviz.logit_rows.default(logits).double()
    x = logits.double()
    log_z = torch.logsumexp(x, dim=-1)
    p = torch.softmax(x, dim=-1)
    wanted = torch.stack([x.amax(dim=-1), log_z, torch.special.xlogy(p, p).sum(dim=-1)])
    scale = torch.maximum(wanted.abs(), torch.ones_like(wanted))
    if found.shape != wanted.shape or not ((found - wanted).abs() <= 2e-5 * scale).all():
        return [f"{name}: {found.tolist()} against {wanted.tolist()}"]
    return []


#: The groups of cases :func:`main` checks, each in its own process when the suite runs them.
GROUPS = ("unit fractions", "channel strengths", "logit rows", "summaries", "summaries with outliers")


def main(groups: tuple[str, ...] = GROUPS) -> int:
    from actviz.statistics import logit_rows
    from actviz.summaries import one_pass

    problems = []
    if "unit fractions" in groups:
        for name, _, flat, units, wanted in unit_cases():
            if not one_pass._takes_triton([flat], units):
                print(f"{name}: the Triton body did not run (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")
                return 2
            problems += unit_mismatches(name, flat, units, wanted)
    if "channel strengths" in groups:
        for case in strength_cases():
            problems += strength_mismatches(*case)
    if "logit rows" in groups:
        for name, logits in logit_cases():
            if not logit_rows._takes_triton(logits):
                print(f"{name}: the Triton body did not run (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")
                return 2
            problems += logit_mismatches(name, logits)
    for outliers, group in ((False, "summaries"), (True, "summaries with outliers")):
        if group not in groups:
            continue
        for name, values, sizes, strides in cases():
            if values.is_contiguous() and not one_pass._takes_triton([values]):
                print(f"{name}: the Triton body did not run (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")
                return 2
            problems += mismatches(name, values, sizes, strides, outliers)
    print("\n".join(problems) or "all match")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or GROUPS))

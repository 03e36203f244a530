"""The buckets of a histogram as actviz counts them, and as it writes them to TensorBoard.

actviz counts ``bins`` buckets of equal width from a tensor's min to its max (:func:`fixed_width_limits`: the
upper edge of each, the last one exactly the max). Many of them are empty: a ReLU's output or a sparse gradient
leaves long stretches with nothing in them. TensorBoard's ``HistogramProto`` holds buckets of any width, each
given by its upper edge, so actviz writes each run of consecutive empty buckets as one empty bucket up to the
run's last edge (:func:`merge_empty_buckets`), as TensorFlow's own ``Histogram::EncodeToProto`` does with
``preserve_zero_buckets=false``. Nothing is lost: every non-empty bucket keeps its own edge and count, and
:func:`expand_empty_buckets` gives the equal-width buckets back from the min, the max and ``bins``.

Example:
    >>> limits, counts = fixed_width_limits(0.0, 4.0, 4), [2.0, 0.0, 0.0, 5.0]
    >>> merge_empty_buckets(limits, counts)
    ([1.0, 3.0, 4.0], [2.0, 0.0, 5.0])
    >>> expand_empty_buckets(0.0, 4.0, *merge_empty_buckets(limits, counts), bins=4)
    ([1.0, 2.0, 3.0, 4.0], [2.0, 0.0, 0.0, 5.0])
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expand_empty_buckets", "fixed_width_limits", "merge_empty_buckets"]


def fixed_width_limits(minimum: float, maximum: float, bins: int) -> list[float]:
    """The upper edge of each of ``bins`` equal buckets from ``minimum`` to ``maximum``; the last is ``maximum``.

    Example:
        >>> fixed_width_limits(-1.0, 1.0, 4)
        [-0.5, 0.0, 0.5, 1.0]
    """
    width = (maximum - minimum) / bins
    limits = [minimum + (index + 1) * width for index in range(bins)]
    limits[-1] = maximum
    return limits


def merge_empty_buckets(limits: Sequence[float], counts: Sequence[float]) -> tuple[list[float], list[float]]:
    """``(limits, counts)`` with each run of two or more empty buckets written as one, up to the run's last edge.

    Buckets whose edges do not strictly increase (a span below a double's resolution) are returned as they
    are, since their runs could not be told apart again.

    Example:
        >>> merge_empty_buckets([1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 3.0, 0.0, 1.0])
        ([2.0, 3.0, 4.0, 5.0], [0.0, 3.0, 0.0, 1.0])
    """
    if any(later <= earlier for earlier, later in zip(limits, limits[1:])):
        return list(limits), list(counts)
    merged_limits: list[float] = []
    merged_counts: list[float] = []
    for limit, count in zip(limits, counts):
        if count == 0 and merged_counts and merged_counts[-1] == 0:
            merged_limits[-1] = limit  # the run of empty buckets goes on to this edge
        else:
            merged_limits.append(limit)
            merged_counts.append(count)
    return merged_limits, merged_counts


def expand_empty_buckets(minimum: float, maximum: float, limits: Sequence[float], counts: Sequence[float],
                         bins: int) -> tuple[list[float], list[float]]:
    """The ``bins`` equal-width buckets of a histogram written by :func:`merge_empty_buckets`.

    Args:
        minimum: The histogram's min (``HistogramProto.min``).
        maximum: Its max.
        limits: The written upper edges (``bucket_limit``).
        counts: The written counts (``bucket``).
        bins: The number of buckets actviz counted (``watch(bins=...)``).

    Returns:
        ``(limits, counts)`` as :meth:`actviz.common.results.Summary.histogram` gives them; a constant tensor's one
        bucket, or buckets that were not merged, as they are.

    Raises:
        ValueError: An edge that is not one of the ``bins`` equal buckets' edges (the histogram was counted with
            another ``bins``, or not by actviz).

    Example:
        >>> expand_empty_buckets(0.0, 3.0, [2.0, 3.0], [0.0, 4.0], bins=3)
        ([1.0, 2.0, 3.0], [0.0, 0.0, 4.0])
    """
    if maximum <= minimum or len(limits) == bins:
        return list(limits), list(counts)
    fixed = fixed_width_limits(minimum, maximum, bins)
    index = {limit: position for position, limit in enumerate(fixed)}
    expanded = [0.0] * bins
    for limit, count in zip(limits, counts):
        if limit not in index:
            raise ValueError(f"bucket edge {limit!r} is not an edge of {bins} equal buckets from {minimum!r} to "
                             f"{maximum!r}; pass the bins= the histogram was counted with")
        expanded[index[limit]] = float(count)
    return fixed, expanded

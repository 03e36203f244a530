"""Histograms are written with each run of empty buckets as one bucket, and read back to the same counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorboard import data_compat
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from tensorboard.util import tensor_util
from torch import nn

import actviz
from actviz.common.histogram_buckets import expand_empty_buckets, fixed_width_limits, merge_empty_buckets

#: One sample's outputs of an identity layer: 0 to 10 in 16 buckets of 0.625, with three empty stretches.
VALUES = [0.0, 0.0, 0.0, 0.1, 2.0, 5.1, 9.9, 10.0]


def test_a_histogram_with_empty_stretches_reads_back_to_the_counts_computed_by_hand(tmp_path, read_run):
    layer = nn.Linear(8, 8)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(8))
        layer.bias.zero_()
    model = nn.Sequential(layer)
    with actviz.watch(model, tmp_path, every=1, image_every=False,
                      options=actviz.Options(bins=16, histogram_sample_size=None)):
        model(torch.tensor([VALUES])).sum().backward()
    histogram = read_run(tmp_path).histogram("activations/0", 0)

    edges = np.linspace(0.0, 10.0, 17)
    by_hand, _ = np.histogram(np.array(VALUES, dtype=np.float64), bins=edges)
    assert by_hand.tolist() == [4, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2]
    # what the file holds: each run of empty buckets is one bucket up to the run's last edge
    assert list(histogram.bucket) == [4, 0, 1, 0, 1, 0, 2]
    assert list(histogram.bucket_limit) == [0.625, 1.875, 2.5, 5.0, 5.625, 9.375, 10.0]
    limits, counts = expand_empty_buckets(histogram.min, histogram.max, histogram.bucket_limit, histogram.bucket, 16)
    assert counts == by_hand.tolist() and limits == edges[1:].tolist()

    # TensorBoard's histogram tab (and the actviz tab) read [left, right, count] triples: the same counts over
    # the same stretches of the axis
    histo = HistogramProto(min=histogram.min, max=histogram.max, num=histogram.num, sum=histogram.sum,
                           sum_squares=histogram.sum_squares, bucket_limit=histogram.bucket_limit,
                           bucket=histogram.bucket)
    triples = data_compat.migrate_value(SummaryProto.Value(tag="h", histo=histo)).tensor
    shown = tensor_util.make_ndarray(triples)
    assert shown[:, 2].tolist() == [4, 0, 1, 0, 1, 0, 2]
    for left, right, count in shown:
        inside = (edges[:-1] >= left) & (edges[1:] <= right)
        assert by_hand[inside].sum() == count, (left, right, count)


def test_merging_then_expanding_gives_the_buckets_back():
    rng = np.random.default_rng(0)
    for _ in range(300):
        bins = int(rng.integers(1, 80))
        counts = (rng.integers(0, 5, bins) * (rng.random(bins) < rng.random())).astype(float).tolist()
        counts[int(rng.integers(bins))] += 1.0  # a histogram is written only when it counts something
        low = float(rng.normal(0, 10.0 ** rng.integers(-6, 6)))
        high = low + float(rng.exponential(10.0 ** rng.integers(-6, 6)))
        limits = fixed_width_limits(low, high, bins)
        merged_limits, merged_counts = merge_empty_buckets(limits, counts)
        assert not any(a == b == 0 for a, b in zip(merged_counts, merged_counts[1:]))  # no two empty in a row
        assert [c for c in merged_counts if c] == [c for c in counts if c]
        assert expand_empty_buckets(low, high, merged_limits, merged_counts, bins) == (limits, counts)


def test_edges_that_do_not_increase_are_not_merged_and_a_wrong_bins_is_named():
    assert merge_empty_buckets([1.0, 1.0, 1.0, 2.0], [0.0, 0.0, 0.0, 3.0]) == ([1.0, 1.0, 1.0, 2.0],
                                                                                 [0.0, 0.0, 0.0, 3.0])
    assert expand_empty_buckets(2.0, 2.0, [2.0], [5.0], bins=64) == ([2.0], [5.0])  # a constant: one bucket
    with pytest.raises(ValueError, match="1.0 is not an edge of 5 equal buckets.*bins="):  # counted with bins=4
        expand_empty_buckets(0.0, 4.0, [1.0, 3.0, 4.0], [2.0, 0.0, 5.0], bins=5)

"""Every view of the actviz tab as JSON, read through a TensorBoard data provider.

The tab (:mod:`actviz.view.plugin`) reads through the provider TensorBoard serves its own tabs from, and
``actviz export`` (:mod:`actviz.view.export`) through one made over the run's folder: both read what
TensorBoard reads, the same way, and no second file format exists. TensorBoard keeps a sample of each tag
(``--samples_per_plugin``: by default 1,000 scalars, 500 histograms and 10 images per tag, always with the
last): the views show those. The JSON of each view:

* ``runs()``: ``[{"run", "statistics": [{"name", "label"}], "layers"}]``, the runs with per-layer statistics;
* ``heatmap(run, statistic)``: layers in forward order, step bins (:mod:`actviz.view.binning`) and per cell
  the max and the last value;
* ``alerts(run)``: ``[{"step", "rule", "layer", "message"}]`` from the run's ``alerts`` texts;
* ``cell(run, layer, step)``: the layer's output and gradient histograms and its feature map at the logged
  step nearest ``step`` (the latest at or before it, else the first after);
* ``feature_maps(run, layer)``: every feature-map step kept, for the slider;
* ``compare(run_a, run_b, statistic)``: both heat maps and where the runs part, by
  :func:`actviz.run_diff.compare_runs` (the logic of ``actviz diff``) over the scalars both hold.
"""

from __future__ import annotations

import base64
import bisect
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..diagnosis.alerts import parse_alert_lines
from ..run_diff import STATISTICS, NoRunToCompare, RunStatistics, compare_runs
from ..tags import ACTIVATIONS, ALERTS, FEATURE_MAPS, GRADIENTS, LAYERS, TENSORBOARD_PREFIX
from .binning import MAX_COLUMNS, bin_steps, json_number
from .layer_tags import label, layer_order, parse_tag, statistic_order, table_layers

__all__ = ["ALL_POINTS", "RunData", "nearest_step"]

#: What the views ask the provider for: every point it kept (it keeps a sample; see the module docstring).
ALL_POINTS = 1_000_000
_SCALARS, _HISTOGRAMS, _IMAGES, _TEXT = "scalars", "histograms", "images", "text"


def nearest_step(steps: list[int], step: int) -> int | None:
    """The latest of the sorted ``steps`` at or before ``step``, else the first after it; ``None`` if none.

    Example:
        >>> nearest_step([0, 10, 20], 15), nearest_step([10, 20], 3), nearest_step([], 3)
        (10, 10, None)
    """
    if not steps:
        return None
    index = bisect.bisect_right(steps, step) - 1
    return steps[max(index, 0)]


class RunData:
    """The views of the runs a TensorBoard data provider holds.

    Args:
        provider: A ``tensorboard.data.provider.DataProvider``.
        experiment_id: The experiment (``""`` for a plain ``tensorboard --logdir``).
        context: TensorBoard's request context, or ``None``.
        blob_url: How a view names an image: from a blob key to a URL (the tab) or ``None`` to embed the PNG
            bytes as a ``data:`` URL (an offline export).
    """

    def __init__(self, provider: Any, experiment_id: str = "", context: Any = None,
                 blob_url: Callable[[str], str] | None = None) -> None:
        self.provider = provider
        self.experiment_id = experiment_id
        self.context = context
        self.blob_url = blob_url

    # -- reading ---------------------------------------------------------------------------------------------

    def _filter(self, runs: list[str] | None = None, tags: list[str] | None = None) -> Any:
        from tensorboard.data.provider import RunTagFilter

        return RunTagFilter(runs=runs, tags=tags)

    def _list(self, kind: str, run: str | None = None) -> dict[str, dict[str, Any]]:
        method = {_SCALARS: "list_scalars", _HISTOGRAMS: "list_tensors", _TEXT: "list_tensors",
                  _IMAGES: "list_blob_sequences"}[kind]
        return getattr(self.provider, method)(self.context, experiment_id=self.experiment_id, plugin_name=kind,
                                              run_tag_filter=None if run is None else self._filter([run]))

    def _read(self, kind: str, run: str, tags: list[str]) -> dict[str, list[Any]]:
        if not tags:
            return {}
        method = {_SCALARS: "read_scalars", _HISTOGRAMS: "read_tensors", _TEXT: "read_tensors",
                  _IMAGES: "read_blob_sequences"}[kind]
        found = getattr(self.provider, method)(self.context, experiment_id=self.experiment_id, plugin_name=kind,
                                               downsample=ALL_POINTS, run_tag_filter=self._filter([run], tags))
        return found.get(run, {})

    def _statistic_tags(self, run: str) -> dict[str, dict[str, str]]:
        """``{statistic: {layer: tag}}`` of the run's per-layer scalars."""
        found: dict[str, dict[str, str]] = defaultdict(dict)
        for tag in self._list(_SCALARS, run).get(run, {}):
            parsed = parse_tag(tag)
            if parsed is not None:
                found[parsed[0]][parsed[1]] = tag
        return found

    def _table(self, run: str) -> list[str]:
        texts = self._read(_TEXT, run, [LAYERS] if LAYERS in self._list(_TEXT, run).get(run, {}) else [])
        for datum in texts.get(LAYERS, []):
            return table_layers(_text(datum.numpy))
        return []

    # -- views -----------------------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """The runs with per-layer statistics, each with its statistics and its layers in forward order."""
        listed = self._list(_SCALARS)
        shown = []
        for run in sorted(listed):
            statistics: dict[str, set[str]] = defaultdict(set)
            for tag in listed[run]:
                parsed = parse_tag(tag)
                if parsed is not None:
                    statistics[parsed[0]].add(parsed[1])
            if statistics:
                layers = layer_order({layer for names in statistics.values() for layer in names}, self._table(run))
                shown.append({"run": run, "layers": layers, "statistics": [
                    {"name": name, "label": label(name)} for name in statistic_order(statistics)]})
        return shown

    def heatmap(self, run: str, statistic: str, columns: int = MAX_COLUMNS) -> dict[str, Any]:
        """One statistic of every layer over the run's steps, binned (see :mod:`actviz.view.binning`).

        Raises:
            KeyError: The run holds no such statistic.
        """
        tags = self._statistic_tags(run).get(statistic)
        if not tags:
            raise KeyError(f"run {run!r} has no statistic {statistic!r}")
        layers = layer_order(tags, self._table(run))
        read = self._read(_SCALARS, run, [tags[layer] for layer in layers])
        series = {layer: [(datum.step, datum.value) for datum in read.get(tags[layer], [])] for layer in layers}
        bins = bin_steps(series, layers, columns)
        positive = [abs(value) for row in bins.max for value in row
                    if isinstance(value, float) and value != 0.0 and math.isfinite(value)]
        return {
            "run": run, "statistic": statistic, "label": label(statistic), "layers": layers,
            "first_steps": bins.first_steps, "last_steps": bins.last_steps, "max": bins.max, "last": bins.last,
            "low": min(positive, default=None), "high": max(positive, default=None),
            "points": sum(len(points) for points in series.values()),
        }

    def alerts(self, run: str) -> list[dict[str, Any]]:
        """The run's alerts, in step order."""
        if ALERTS not in self._list(_TEXT, run).get(run, {}):
            return []
        found = []
        for datum in self._read(_TEXT, run, [ALERTS]).get(ALERTS, []):
            for step, rule, layer, message in parse_alert_lines(_text(datum.numpy), datum.step):
                found.append({"step": step, "rule": rule, "layer": layer, "message": message})
        return sorted(found, key=lambda alert: alert["step"])

    def _image_source(self, blob_key: str) -> str:
        if self.blob_url is not None:
            return self.blob_url(blob_key)
        data = self.provider.read_blob(self.context, blob_key=blob_key)
        return "data:image/png;base64," + base64.b64encode(data).decode("ascii")

    def feature_maps(self, run: str, layer: str) -> list[dict[str, Any]]:
        """Every kept feature-map picture of ``layer``: ``[{"step", "src"}]``, in step order."""
        tag = TENSORBOARD_PREFIX + FEATURE_MAPS.format(layer=layer)
        if tag not in self._list(_IMAGES, run).get(run, {}):
            return []
        pictures = []
        for datum in self._read(_IMAGES, run, [tag]).get(tag, []):
            if len(datum.values) > 2:  # width, height, then the picture
                pictures.append({"step": datum.step, "src": self._image_source(datum.values[2].blob_key)})
        return pictures

    def histograms(self, run: str, layer: str) -> dict[str, list[dict[str, Any]]]:
        """The layer's kept output and gradient histograms: ``{"activations": [{"step", "buckets"}], ...}``."""
        listed = self._list(_HISTOGRAMS, run).get(run, {})
        found = {}
        for kind, pattern in (("activations", ACTIVATIONS), ("gradients", GRADIENTS)):
            tag = TENSORBOARD_PREFIX + pattern.format(layer=layer)
            data = self._read(_HISTOGRAMS, run, [tag]).get(tag, []) if tag in listed else []
            found[kind] = [{"step": datum.step, "buckets": [[json_number(float(number)) for number in bucket]
                                                            for bucket in datum.numpy.tolist()]} for datum in data]
        return found

    def cell(self, run: str, layer: str, step: int) -> dict[str, Any]:
        """What a click on a cell opens: the layer's histograms and feature map at the logged step nearest ``step``."""
        shown: dict[str, Any] = {"run": run, "layer": layer, "step": step}
        for kind, entries in self.histograms(run, layer).items():
            at = nearest_step([entry["step"] for entry in entries], step)
            shown[kind] = next((entry for entry in entries if entry["step"] == at), None)
        pictures = self.feature_maps(run, layer)
        at = nearest_step([picture["step"] for picture in pictures], step)
        shown["feature_map"] = next((picture for picture in pictures if picture["step"] == at), None)
        return shown

    def compare(self, run_a: str, run_b: str, statistic: str, rtol: float = 1e-3, atol: float = 0.0,
                ) -> dict[str, Any]:
        """Both runs' heat maps of ``statistic`` and where they part (``actviz diff``'s rule, over the scalars)."""
        shown: dict[str, Any] = {"a": self.heatmap(run_a, statistic), "b": self.heatmap(run_b, statistic),
                                 "rtol": rtol, "atol": atol, "first_divergence": None, "differing": [], "error": None}
        try:
            comparison = compare_runs(self._run_statistics(run_a), self._run_statistics(run_b), rtol, atol)
        except NoRunToCompare as error:
            shown["error"] = str(error)
            return shown
        shown["common_steps"] = len(comparison.common_steps)
        if comparison.first_divergence is not None:
            shown["first_divergence"] = _difference(comparison.first_divergence)
            shown["differing"] = [_difference(difference) for difference in comparison.differing]
        return shown

    def _run_statistics(self, run: str) -> RunStatistics:
        """The scalars of :data:`actviz.run_diff.STATISTICS` as ``actviz diff`` reads them, from the provider."""
        wanted: dict[str, tuple[str, str]] = {}
        for tag in self._list(_SCALARS, run).get(run, {}):
            parsed = parse_tag(tag)
            if parsed is None:
                continue
            for name, (prefix, source) in STATISTICS.items():
                if source.startswith("stat:") and parsed[0] == prefix + source.removeprefix("stat:"):
                    wanted[tag] = (parsed[1], name)
        steps: dict[int, dict[tuple[str, str], float]] = defaultdict(dict)
        for tag, data in self._read(_SCALARS, run, list(wanted)).items():
            for datum in data:
                steps[datum.step][wanted[tag]] = float(datum.value)
        layers = layer_order({layer for layer, _ in wanted.values()}, self._table(run))
        return RunStatistics(run, layers, dict(sorted(steps.items())))


def _difference(difference: Any) -> dict[str, Any]:
    return {"step": difference.step, "layer": difference.layer, "statistic": difference.statistic,
            "a": json_number(difference.a), "b": json_number(difference.b)}


def _text(array: Any) -> str:
    """A text summary's string (TensorBoard keeps it as a numpy array of bytes)."""
    item = array.item() if array.size == 1 else array.reshape(-1)[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)

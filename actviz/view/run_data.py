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
import json
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..diagnosis.alerts import parse_alert_lines
from ..diagnosis.colour_scale import FRACTIONS, colour_floor
from ..common._tensorboard_internals import scalar_arrays
from ..run_diff import STATISTICS, NoRunToCompare
from ..tags import ACTIVATIONS, ALERTS, FEATURE_MAPS, GRADIENTS, LAYERS, TENSORBOARD_PREFIX
from .binning import MAX_COLUMNS, bin_steps, json_number
from .layer_tags import label, layer_order, parse_tag, statistic_order, table_layers
from .run_compare import ScalarTable, compare_tables

__all__ = ["ALL_POINTS", "CACHED_VIEWS", "RawJSON", "RunData", "nearest_step", "to_json"]

#: What the views ask the provider for: every point it kept (it keeps a sample; see the module docstring).
ALL_POINTS = 1_000_000
_SCALARS, _HISTOGRAMS, _IMAGES, _TEXT = "scalars", "histograms", "images", "text"
#: Heat maps kept, newest used last: switching back to a statistic or a run costs no second read.
CACHED_VIEWS = 32


class RawJSON(str):
    """JSON text that :func:`to_json` puts in as it is (a heat map's rows, written fast)."""


def to_json(value: Any) -> str:
    """``value`` as JSON, with each :class:`RawJSON` in it as written.

    Example:
        >>> to_json({"rows": RawJSON("[[1,null]]"), "name": "a"})
        '{"rows":[[1,null]],"name":"a"}'
    """
    raws: list[str] = []

    def place(item: Any) -> Any:
        if isinstance(item, RawJSON):
            raws.append(item)
            return f"\0raw{len(raws) - 1}\0"
        if isinstance(item, dict):
            return {key: place(entry) for key, entry in item.items()}
        if isinstance(item, list):
            return [place(entry) for entry in item]
        return item

    text = json.dumps(place(value), allow_nan=False, separators=(",", ":"))
    for index, raw in enumerate(raws):
        text = text.replace(f'"\\u0000raw{index}\\u0000"', raw, 1)
    return text


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
        cache: Where heat maps are kept between calls (the tab's one dict), each under its run's last step and
            point count, so that a run that grows is read again.
    """

    def __init__(self, provider: Any, experiment_id: str = "", context: Any = None,
                 blob_url: Callable[[str], str] | None = None, cache: OrderedDict | None = None) -> None:
        self.provider = provider
        self.experiment_id = experiment_id
        if context is None:
            from tensorboard.context import RequestContext

            context = RequestContext()
        self.context = context
        self.blob_url = blob_url
        self.cache: OrderedDict = OrderedDict() if cache is None else cache

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

    def _statistic_tags(self, run: str) -> tuple[dict[str, dict[str, str]], tuple[int, int]]:
        """``{statistic: {layer: tag}}`` of the run's per-layer scalars, and the run's last step and point count."""
        found: dict[str, dict[str, str]] = defaultdict(dict)
        listed = self._list(_SCALARS, run).get(run, {})
        for tag in listed:
            parsed = parse_tag(tag)
            if parsed is not None:
                found[parsed[0]][parsed[1]] = tag
        version = (max((series.max_step for series in listed.values()), default=-1),
                   sum(getattr(series, "max_wall_time", 0) for series in listed.values()))
        return found, version

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
        statistics, version = self._statistic_tags(run)
        tags = statistics.get(statistic)
        if not tags:
            raise KeyError(f"run {run!r} has no statistic {statistic!r}")
        key = (self.experiment_id, run, statistic, columns, version)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        layers = layer_order(tags, self._table(run))
        read = self._scalar_arrays(run, [tags[layer] for layer in layers])
        series = {layer: read[tags[layer]] for layer in layers if tags[layer] in read}
        bins = bin_steps(series, layers, columns)
        sizes = np.abs(bins.max[~bins.empty & np.isfinite(bins.max) & (bins.max != 0)])
        shown = {
            "run": run, "statistic": statistic, "label": label(statistic), "layers": layers,
            "first_steps": bins.first_steps, "last_steps": bins.last_steps,
            "max": RawJSON(bins.matrix_json("max")), "last": RawJSON(bins.matrix_json("last")),
            # the colour scale's ends: from the statistic's floor (noise is the darkest colour), a fraction's to 1
            "low": max(float(sizes.min()), colour_floor(statistic)) if sizes.size else None,
            "high": (1.0 if statistic.rsplit("/", 1)[-1] in FRACTIONS else float(sizes.max())) if sizes.size else None,
            "points": sum(len(steps) for steps, _ in series.values()),
        }
        self.cache[key] = shown
        while len(self.cache) > CACHED_VIEWS + 1:  # the heat maps, and the runs kept for comparing
            oldest = next(key for key in self.cache if key != "compare")
            del self.cache[oldest]
        return shown

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

    def compare(self, run_a: str, run_b: str, rtol: float = 1e-3, atol: float = 0.0) -> dict[str, Any]:
        """Where two runs part: :func:`actviz.run_diff.compare_runs` (``actviz diff``'s rule) over the scalars both
        hold, checked with numpy first (:mod:`actviz.view.run_compare`): the same answer in a fraction of the time."""
        shown: dict[str, Any] = {"a": run_a, "b": run_b, "rtol": rtol, "atol": atol, "first_divergence": None,
                                 "differing": [], "error": None, "common_steps": 0}
        first, second = self._run_statistics(run_a), self._run_statistics(run_b)
        shown["common_steps"] = int(np.intersect1d(first.steps, second.steps).size)
        try:
            comparison = compare_tables(first, second, rtol, atol)
        except NoRunToCompare as error:
            shown["error"] = str(error)
            return shown
        if comparison.first_divergence is not None:
            shown["first_divergence"] = _difference(comparison.first_divergence)
            shown["differing"] = [_difference(difference) for difference in comparison.differing]
        return shown

    def _run_statistics(self, run: str) -> ScalarTable:
        """The scalars of :data:`actviz.run_diff.STATISTICS` as ``actviz diff`` reads them, from the provider; the
        last two runs read are kept (``cache``), each under its last step and point count."""
        listed = self._list(_SCALARS, run).get(run, {})
        key = ("compare", self.experiment_id, run, max((series.max_step for series in listed.values()), default=-1),
               sum(getattr(series, "max_wall_time", 0) for series in listed.values()))
        kept = self.cache.setdefault("compare", OrderedDict())
        if key in kept:
            return kept[key]
        kept[key] = found = self._read_run_statistics(run, listed)
        while len(kept) > 2:
            kept.popitem(last=False)
        return found

    def _read_run_statistics(self, run: str, listed: dict[str, Any]) -> ScalarTable:
        wanted: dict[str, tuple[str, str]] = {}
        for tag in listed:
            parsed = parse_tag(tag)
            if parsed is None:
                continue
            for name, (prefix, source) in STATISTICS.items():
                if source.startswith("stat:") and parsed[0] == prefix + source.removeprefix("stat:"):
                    wanted[tag] = (parsed[1], name)
        series = {wanted[tag]: points for tag, points in self._scalar_arrays(run, list(wanted)).items()}
        layers = layer_order({layer for layer, _ in wanted.values()}, self._table(run))
        return ScalarTable.from_series(run, layers, series)

    def _scalar_arrays(self, run: str, tags: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{tag: (steps, values)}`` of scalar tags as numpy arrays, every point the provider kept: straight from
        the data server's answer where TensorBoard reads through one (``tensorboard --logdir``, ``actviz export``),
        else through the provider's ``read_scalars``."""
        if not tags:
            return {}
        found = scalar_arrays(self.provider, self.experiment_id, run, tags, ALL_POINTS)
        if found is not None:
            return found
        return {tag: (np.fromiter((datum.step for datum in data), dtype=np.int64, count=len(data)),
                      np.fromiter((datum.value for datum in data), dtype=np.float64, count=len(data)))
                for tag, data in self._read(_SCALARS, run, tags).items()}


def _difference(difference: Any) -> dict[str, Any]:
    return {"step": difference.step, "layer": difference.layer, "statistic": difference.statistic,
            "a": json_number(difference.a), "b": json_number(difference.b)}


def _text(array: Any) -> str:
    """A text summary's string (TensorBoard keeps it as a numpy array of bytes)."""
    item = array.item() if array.size == 1 else array.reshape(-1)[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)

"""The actviz tab without a server: one self-contained HTML file, and the same page inline in a notebook.

:func:`export_html` reads a folder of runs as TensorBoard does, through TensorBoard's own data provider over the
event files (its data server, :func:`open_runs`), with TensorBoard's default samples per tag, and writes one HTML file: the views of
:class:`~actviz.view.run_data.RunData` as JSON in a ``<script type="application/json">``, then the tab's ES
module (``static/view.js``) inline. No server, no network: it opens from disk (``file://``) and can be attached
to an issue. Per layer it keeps :data:`HISTOGRAM_STEPS` histogram steps of each kind and every feature map
TensorBoard keeps (10), PNGs as ``data:`` URLs. :func:`show` returns the same page for a notebook cell:
an ``<iframe srcdoc=...>``, which Jupyter, JupyterLab and VS Code render.

Example:
    >>> import tempfile
    >>> page = show(tempfile.mkdtemp())  # a folder with no run: the page says so
    >>> "actviz-data" in page._repr_html_()
    True
"""

from __future__ import annotations

import contextlib
import html
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .binning import MAX_COLUMNS
from .data_server import DataServerUnavailable, data_server_provider
from .run_data import RunData, to_json

__all__ = ["HISTOGRAM_STEPS", "Page", "export_html", "html_page", "local_provider", "open_runs", "show", "view_data"]

#: Histogram steps an export keeps per layer and kind (output, gradient), evenly spread, the last among them.
HISTOGRAM_STEPS = 20
#: Most runs an export compares pairwise.
COMPARED_RUNS = 6
_SCRIPT = Path(__file__).parent / "static" / "view.js"
_LOGGER = logging.getLogger(__name__)


def local_provider(folder: str | os.PathLike[str], samples: dict[str, int] | None = None) -> Any:
    """TensorBoard's Python data provider over the runs in ``folder``, loaded once, keeping what ``tensorboard
    --logdir`` keeps (``samples``: ``--samples_per_plugin``, e.g. ``{"scalars": 100000}``). It reads about 10,000
    scalars a second: :func:`open_runs` uses TensorBoard's data server where it can."""
    from tensorboard.backend.event_processing import data_ingester, event_accumulator
    from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance=event_accumulator.DEFAULT_SIZE_GUIDANCE,
                                   tensor_size_guidance={**data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE, **(samples or {})})
    multiplexer.AddRunsFromDirectory(str(folder))
    multiplexer.Reload()
    return MultiplexerDataProvider(multiplexer, str(folder))


@contextlib.contextmanager
def open_runs(folder: str | os.PathLike[str], samples: dict[str, int] | None = None) -> Iterator[Any]:
    """A data provider over the runs in ``folder``: TensorBoard's data server (:mod:`actviz.view.data_server`), as
    ``tensorboard --logdir`` uses it, or where it cannot start, TensorBoard's Python loader."""
    try:
        with data_server_provider(folder, samples) as provider:
            yield provider
            return
    except DataServerUnavailable as error:
        _LOGGER.info("reading %s with TensorBoard's Python loader: %s", os.fspath(folder), error)
    yield local_provider(folder, samples)


def _spread(entries: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``entries``, evenly spread, the last kept."""
    if len(entries) <= most:
        return entries
    picked = {round(index * (len(entries) - 1) / (most - 1)) for index in range(most)}
    return [entry for index, entry in enumerate(entries) if index in picked]


def view_data(data: RunData, columns: int = MAX_COLUMNS) -> dict[str, Any]:
    """Every view of every run that :func:`export_html` embeds."""
    runs = data.runs()
    embedded: dict[str, Any] = {"runs": runs, "heatmaps": {}, "alerts": {}, "histograms": {}, "feature_maps": {},
                                "divergences": {}}
    for run in runs:
        name = run["run"]
        embedded["heatmaps"][name] = {entry["name"]: data.heatmap(name, entry["name"], columns)
                                      for entry in run["statistics"]}
        embedded["alerts"][name] = data.alerts(name)
        embedded["histograms"][name] = {
            layer: {kind: _spread(entries, HISTOGRAM_STEPS) for kind, entries in data.histograms(name, layer).items()}
            for layer in run["layers"]}
        embedded["feature_maps"][name] = {layer: pictures for layer in run["layers"]
                                          if (pictures := data.feature_maps(name, layer))}
    names = [run["run"] for run in runs[:COMPARED_RUNS]]
    for run_a, run_b in itertools.permutations(names, 2):
        embedded["divergences"][f"{run_a}\n{run_b}"] = data.compare(run_a, run_b)
    return embedded


def html_page(embedded: dict[str, Any], title: str = "actviz") -> str:
    """One HTML document: ``embedded`` as JSON, then the tab's module inline, which draws it."""
    payload = to_json(embedded)
    payload = payload.replace("</", "<\\/").replace("<!--", "<\\u0021--")  # nothing in the JSON ends its script
    script = _SCRIPT.read_text(encoding="utf-8")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title></head>\n<body>\n"
        f"<script type=\"application/json\" id=\"actviz-data\">{payload}</script>\n"
        f"<script type=\"module\">\n{script}\nrender();\n</script>\n</body></html>\n"
    )


def export_html(folder: str | os.PathLike[str], file: str | os.PathLike[str], columns: int = MAX_COLUMNS,
                samples: dict[str, int] | None = None) -> Path:
    """Write the views of the runs in ``folder`` to one self-contained HTML ``file``; returns its path.

    Raises:
        FileNotFoundError: ``folder`` is not a folder, or holds no actviz run.
    """
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"{os.fspath(folder)!r} is not a folder; give the folder actviz.watch() wrote to")
    embedded = {"runs": []}
    if any(Path(folder).rglob("*tfevents*")):  # else no server to start
        with open_runs(folder, samples) as provider:
            embedded = view_data(RunData(provider), columns)
    if not embedded["runs"]:
        raise FileNotFoundError(f"no actviz run in {os.fspath(folder)!r}: no per-layer statistics (~activation_stats/, "
                                "~gradient_stats/); give the folder actviz.watch() wrote to")
    page = html_page(embedded, f"actviz: {Path(folder).name}")
    target = Path(file)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(page, encoding="utf-8")
    partial.replace(target)  # nothing half-written under the name asked for
    return target


class Page:
    """An exported page for a notebook cell: ``_repr_html_`` is an ``<iframe srcdoc=...>`` of it."""

    def __init__(self, document: str, height: int = 900) -> None:
        self.document = document
        self.height = height

    def _repr_html_(self) -> str:
        return (f'<iframe class="actviz-view" srcdoc="{html.escape(self.document, quote=True)}" '
                f'style="width: 100%; height: {self.height}px; border: 0"></iframe>')

    def save(self, file: str | os.PathLike[str]) -> Path:
        """Write the page to ``file``, as ``actviz export --html`` does."""
        Path(file).write_text(self.document, encoding="utf-8")
        return Path(file)


def show(folder: str | os.PathLike[str], height: int = 900, columns: int = MAX_COLUMNS) -> Page:
    """The actviz view of the runs in ``folder``, for a notebook: the last expression of a cell renders it.

    Example: ``actviz.show("runs/exp1")``, or ``viz.show()`` on a watcher.
    """
    with open_runs(folder) as provider:
        embedded = view_data(RunData(provider), columns)
    return Page(html_page(embedded, f"actviz: {Path(folder).name}"), height)

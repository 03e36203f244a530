"""The actviz tab of TensorBoard: a plugin shipped in the package, found through the ``tensorboard_plugins`` entry
point of pyproject.toml whenever actviz is installed beside TensorBoard.

TensorBoard loads :data:`static/view.js <STATIC>` in an iframe (``frontend_metadata(es_module_path=...)``) and the
module fetches its views from the routes below, each a JSON view of :class:`~actviz.view.run_data.RunData` read
through ``context.data_provider``, the provider TensorBoard's own tabs read:

=====================  ===============================================================
``/runs``              the runs with per-layer statistics
``/heatmap``           ``run``, ``statistic``: layers x step bins
``/alerts``            ``run``: the alerts
``/cell``              ``run``, ``layer``, ``step``: histograms and feature map there
``/feature_maps``      ``run``, ``layer``: every kept feature map
``/compare``           ``a``, ``b``: where two runs part
``/blob``              ``key``: a picture's PNG
=====================  ===============================================================

The tab is listed (``/data/plugins_listing``) wherever a run holds a scalar of actviz's per-layer statistics.

Example:
    >>> from tensorboard.plugins.base_plugin import TBContext
    >>> plugin = ActvizPlugin(TBContext(data_provider=None))
    >>> plugin.plugin_name, plugin.frontend_metadata().es_module_path, plugin.is_active()
    ('actviz', '/view.js', False)
"""

from __future__ import annotations

import logging
import urllib.parse
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from .layer_tags import parse_tag
from .run_data import RunData, to_json

__all__ = ["PLUGIN_NAME", "STATIC", "ActvizPlugin"]

PLUGIN_NAME = "actviz"
#: The tab's frontend: plain ES modules, no build step.
STATIC = Path(__file__).parent / "static"
_LOGGER = logging.getLogger(__name__)


class ActvizPlugin(base_plugin.TBPlugin):
    """The actviz tab: layers x steps of one statistic, alerts on the same axis, two runs side by side, feature maps.

    Args:
        context: TensorBoard's ``TBContext``; its ``data_provider`` is what the tab reads.
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider
        self._cache: OrderedDict = OrderedDict()  # heat maps, shared by the requests (run_data.CACHED_VIEWS)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/view.js", tab_name="actviz", disable_reload=False)

    def is_active(self) -> bool:
        """True where a run holds a per-layer statistic of actviz (the tab is then listed as enabled)."""
        if self._provider is None:
            return False
        from tensorboard.context import RequestContext

        listed = self._provider.list_scalars(RequestContext(), experiment_id="", plugin_name="scalars")
        return any(parse_tag(tag) is not None for tags in listed.values() for tag in tags)

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/view.js": self._static,
            "/runs": self._json(lambda data, args: data.runs()),
            "/heatmap": self._json(lambda data, args: data.heatmap(args["run"], args["statistic"])),
            "/alerts": self._json(lambda data, args: data.alerts(args["run"])),
            "/cell": self._json(lambda data, args: data.cell(args["run"], args["layer"], int(args["step"]))),
            "/feature_maps": self._json(lambda data, args: data.feature_maps(args["run"], args["layer"])),
            "/compare": self._json(lambda data, args: data.compare(args["a"], args["b"])),
            "/blob": self._blob,
        }

    def _data(self, request: Any) -> RunData:
        return RunData(self._provider, plugin_util.experiment_id(request.environ),
                       plugin_util.context(request.environ),
                       blob_url=lambda key: "./blob?" + urllib.parse.urlencode({"key": key}), cache=self._cache)

    def _json(self, view: Any) -> Any:
        @wrappers.Request.application
        def serve(request: Any) -> Any:
            try:
                body = view(self._data(request), request.args)
            except KeyError as error:  # a missing argument, or a run or statistic that is not there
                raise errors.NotFoundError(str(error.args[0]) if error.args else "missing argument") from None
            except ValueError as error:  # a step that is not a number
                raise errors.InvalidArgumentError(str(error)) from None
            return http_util.Respond(request, to_json(body), "application/json")

        return serve

    @wrappers.Request.application
    def _static(self, request: Any) -> Any:
        return http_util.Respond(request, (STATIC / "view.js").read_bytes(), "text/javascript")

    @wrappers.Request.application
    def _blob(self, request: Any) -> Any:
        data = self._provider.read_blob(plugin_util.context(request.environ), blob_key=request.args["key"])
        return http_util.Respond(request, data, "image/png")

"""The actviz view: every layer over time, one statistic at a time, with alerts, two runs side by side and feature
maps, in TensorBoard's actviz tab (:mod:`actviz.view.plugin`), in one offline HTML file (``actviz export``) and
inline in a notebook (:func:`show`, ``viz.show()``). docs/view.md shows it.

Modules: :mod:`~actviz.view.layer_tags` (which layer and statistic a tag is), :mod:`~actviz.view.binning`
(steps onto columns), :mod:`~actviz.view.run_data` (each view as JSON, through a TensorBoard data provider),
:mod:`~actviz.view.plugin` (the tab), :mod:`~actviz.view.export` (the file and the notebook page),
:mod:`~actviz.view.command` (``actviz export``), and ``static/view.js``, the page itself.

Example:
    >>> import tempfile
    >>> export_html(tempfile.mkdtemp(), "view.html")  # a folder with no run
    Traceback (most recent call last):
    ...
    FileNotFoundError: no actviz run in '...': no per-layer statistics (...); give the folder actviz.watch() wrote to
"""

from .export import export_html, show

__all__ = ["export_html", "show"]

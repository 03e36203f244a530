"""``actviz export RUN --html FILE``: the actviz tab's views of a run, as one HTML file that opens from disk.

Exit codes: 0 written, 2 no actviz run in the folder or the file cannot be written.

Example:
    >>> import tempfile
    >>> from actviz.cli import main
    >>> main(["export", tempfile.mkdtemp(), "--html", "view.html"])  # no run there: says so on stderr
    2
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["EXPORT_DESCRIPTION", "add_export_parser", "run_export"]

EXPORT_DESCRIPTION = """\
Write the views of TensorBoard's actviz tab for the runs in a folder to one self-contained
HTML file: layers x steps of each per-layer statistic, the alerts on the same step axis,
two runs side by side, each layer's histograms and feature maps. The data is inside the
file; it needs no server and no network, and opens from disk in any recent browser.
"""

EXPORT_EPILOG = """\
examples:
  actviz export runs/exp1 --html exp1.html          # one run (or a folder of runs)
  actviz export runs --html runs.html --columns 200   # every run below runs/, 200 step columns

It reads what `tensorboard --logdir RUN` shows, as TensorBoard samples it: by default 1,000
scalars, 500 histograms and 10 images per tag. --samples scalars=20000 keeps more.

exit codes: 0 written, 2 no actviz run in the folder or the file cannot be written.
"""


def add_export_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add ``export`` to the ``actviz`` command's subcommands."""
    export = commands.add_parser("export", help="the actviz tab's views as one offline HTML file",
                                 description=EXPORT_DESCRIPTION, epilog=EXPORT_EPILOG, formatter_class=formatter)
    export.add_argument("run_dir", metavar="RUN", help="a run folder (actviz.watch's log_dir), or a folder of runs")
    export.add_argument("--html", required=True, metavar="FILE", help="the HTML file to write")
    export.add_argument("--columns", type=int, default=500, metavar="N",
                        help="most step columns per heat map; each keeps the max and the last of its steps")
    export.add_argument("--samples", action="append", default=[], metavar="KIND=N",
                        help="TensorBoard's --samples_per_plugin, e.g. scalars=20000; repeat for several")


def run_export(args: argparse.Namespace) -> tuple[int, str]:
    """Run ``actviz export``: its exit code and the line to print (on stderr when it is not 0)."""
    from .export import export_html

    try:
        samples = {kind: int(count) for kind, count in (item.split("=", 1) for item in args.samples)}
    except ValueError:
        return 2, f"actviz: error: --samples takes KIND=N, got {args.samples}; for example --samples scalars=20000"
    if args.columns < 1:
        return 2, f"actviz: error: --columns must be at least 1, got {args.columns}; for example --columns 500"
    try:
        path = export_html(args.run_dir, args.html, args.columns, samples)
    except OSError as error:
        return 2, f"actviz: error: {error}"
    return 0, f"wrote {path}"

"""actviz: see inside your PyTorch network while it trains.

One line attaches it to a training loop::

    import actviz
    viz = actviz.watch(model, "runs/exp1")

Then ``tensorboard --logdir runs`` shows feature-map grids, activation and
gradient histograms, parameter histograms and per-layer statistics.
"""

from .capture import CaptureOptions, StepResults
from .rendering import feature_map_grid, heatmap
from .report import ReportResult, report
from .schedule import Schedule
from .selection import select_layers
from .summaries import Summary, summarize
from .watcher import Watcher, watch

__version__ = "0.1.0"

__all__ = [
    "watch",
    "report",
    "ReportResult",
    "Watcher",
    "select_layers",
    "summarize",
    "Summary",
    "feature_map_grid",
    "heatmap",
    "Schedule",
    "CaptureOptions",
    "StepResults",
    "__version__",
]

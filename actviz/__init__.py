"""actviz: see inside your PyTorch network while it trains.

One line attaches it to a training loop::

    import actviz
    viz = actviz.watch(model, "runs/exp1")

Then ``tensorboard --logdir runs`` shows feature-map grids, activation and
gradient histograms, parameter histograms and per-layer statistics.
"""

from ._version import __version__
from .alerts import Alert
from .api import watch
from .gradcam import grad_cam
from .options import CaptureOptions
from .rendering import feature_map_grid, heatmap
from .report import ReportResult, report
from .report.images import load_images
from .results import StepResults, Summary
from .schedule import Schedule
from .selection import select_layers
from .summaries import summarize
from .watcher import Watcher

__all__ = [
    "watch",
    "Alert",
    "grad_cam",
    "load_images",
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

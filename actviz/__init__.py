"""actviz: see inside your PyTorch network while it trains.

One line attaches it to a training loop, ``viz = actviz.watch(model, "runs/exp1")``;
then ``tensorboard --logdir runs`` shows feature-map grids, activation and gradient
histograms, parameter histograms and per-layer statistics.

Example:
    >>> import tempfile, torch, actviz
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    >>> with tempfile.TemporaryDirectory() as runs, actviz.watch(model, runs) as viz:
    ...     model(torch.randn(8, 3, 4, 4)).sum().backward()  # step 0: logged (the default logs steps 0-9, then every 10th up to 990, then every 100th)
    ...     viz.flush()
    ...     print(viz.layer_names, sorted(viz.latest.images))
    ['0', '3'] ['0']
"""

from ._version import __version__
from .diagnosis.alerts import Alert
from .api import watch
from .pictures.gradcam import grad_cam
from .extras import Probe, Spikes
from .options import CaptureOptions, Options
from .common.results import StepResults, Summary
from .pictures.rendering import feature_map_grid, heatmap
from .report import ReportResult, report
from .report.images import load_images
from .schedule import Schedule
from .selection import select_layers
from .statistics import LayerStatistic
from .summaries.one_tensor import summarize
from .watcher import Watcher
from .view import export_html, show

__all__ = [
    "watch",
    "Options",
    "Probe",
    "Spikes",
    "show",
    "export_html",
    "Alert",
    "LayerStatistic",
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

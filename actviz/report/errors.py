"""The report's errors. The ``actviz`` command turns :class:`ReportError` into exit code 2.

Example:
    >>> import actviz
    >>> try:
    ...     actviz.report("vgg61", ["cat.jpg"], logdir=None, progress=False)
    ... except ReportError as error:
    ...     print(str(error).split(";")[0])
    unknown model 'vgg61'
"""

from __future__ import annotations

__all__ = ["ImageError", "ReportError", "WeightsError"]


class ReportError(Exception):
    """The report cannot start: unknown model or layer, bad option or unusable weights."""


class WeightsError(ReportError):
    """Weights could not be downloaded, read or matched to the model."""


class ImageError(ReportError):
    """One image could not be read; the report goes on with the others."""

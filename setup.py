"""Build the optional C extension ``actviz._fused``; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and
actviz keeps to its NumPy code (see ``actviz.summaries.FUSED``).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("actviz._fused", sources=["actviz/_fused.c"], optional=True)])

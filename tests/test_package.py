"""The package's shape: one version, small modules, no import cycle, light imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import actviz

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_actviz_version_py() -> None:
    # Expand pyproject.toml as pip does when it builds the package (attr: is read statically).
    code = (
        "from setuptools.config.pyprojecttoml import read_configuration; "
        "print(read_configuration('pyproject.toml', expand=True)['project']['version'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == actviz.__version__
    from actviz._version import __version__

    assert __version__ == actviz.__version__ and __version__.count(".") == 2

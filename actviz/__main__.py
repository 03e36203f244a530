"""``python -m actviz`` runs the ``actviz`` command line (see :mod:`actviz.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())

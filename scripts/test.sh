#!/usr/bin/env bash
# Install actviz with its test extras and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
python -m pytest "$@"

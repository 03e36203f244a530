#!/usr/bin/env bash
# Install actviz and train a small CNN for about a minute with actviz.watch attached.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python scripts/demo_train.py "$@"

#!/usr/bin/env bash
# On a machine with a CUDA GPU (H100/H200): actviz's whole GPU check in one call of at most 540 s, one table at the end.
# This runs scripts/check_gpu.py (see `python scripts/check_gpu.py --help`); its options pass through:
#   bash scripts/check_gpu.sh [--out DIR] [--budget S] [--skip PHASES] [--smoke]
# Logs and the table (table.txt, table.json) go to DIR: default $OUT if set, else gpu-logs/. Exit status 1 if any row
# failed, an actviz warning included.
set -u -o pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" scripts/check_gpu.py "$@"

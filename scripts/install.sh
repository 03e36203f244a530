#!/usr/bin/env bash
# Install actviz (editable) into the current Python, with the extras named in $1 (e.g. "dev").
# PyTorch comes first, from the versions this kind of machine keeps on disk, because
# a bare "pip install torch" would try to download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

if ! python -c "import torch, torchvision" >/dev/null 2>&1; then
    case "$(uname -m)" in
        aarch64|arm64) torch_pins=(torch==2.9.1 torchvision==0.24.1) ;;
        *)             torch_pins=(torch==2.14.1 torchvision==0.29.1) ;;
    esac
    echo "== installing ${torch_pins[*]}"
    python -m pip install --quiet "${torch_pins[@]}"
fi

target="."
[ -n "$extras" ] && target=".[$extras]"
echo "== installing actviz from $PWD ($target)"
python -m pip install --quiet --disable-pip-version-check -e "$target"

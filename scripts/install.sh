#!/usr/bin/env bash
# Install actviz (editable) into the current Python, with the extras named in $1 (e.g. "dev").
# It says what it installs and about how long each part takes, then how long it took.
# PyTorch comes first, pinned to the release the tests run on. On x86_64 Linux, PyPI's torch is
# the CUDA build: about 3 GB of wheels and 5.5 GB on disk (its NVIDIA libraries are 3.2 GB of
# it). Installing it from wheels already on disk took 49 s on an idle 2-core machine and 8.5
# minutes on a busy one; downloading them comes on top.
# ACTVIZ_INSTALL_DRY_RUN=1 prints the plan and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
dry_run="${ACTVIZ_INSTALL_DRY_RUN:-0}"
started=$SECONDS

run() {
    if [ "$dry_run" = 1 ]; then echo "   (dry run, not run) $*"; else "$@"; fi
}

echo "== installing actviz into $(python -c 'import sys; print(sys.prefix)') ($(python --version 2>&1))"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    echo "   note: no virtual environment is active, so the packages go into this Python itself. To keep"
    echo "   them apart, press Ctrl-C now, run: python -m venv .venv && source .venv/bin/activate, and start again"
fi

# What pyproject.toml asks for, so that this message cannot drift from it.
read -r version packages < <(python - "$extras" <<'EOF'
import re, sys
text = open("pyproject.toml").read()
version = re.search(r'__version__ = "([^"]+)"', open("actviz/_version.py").read()).group(1)
def names(block):
    return [re.split(r"[<>=\[ ;]", item, 1)[0] for item in re.findall(r'"([^"]+)"', block)]
wanted = names(re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1))
for extra in filter(None, sys.argv[1].split(",")):
    found = re.search(rf"^{re.escape(extra)} = \[(.*?)\]", text, re.S | re.M)
    wanted += names(found.group(1)) if found else [f"(unknown extra {extra})"]
print(version, ", ".join(wanted))
EOF
)

step=$SECONDS
if python -c "import torch, torchvision" >/dev/null 2>&1; then
    echo "== 1/2 PyTorch: already installed ($(python -c 'import torch, torchvision; print("torch", torch.__version__, "and torchvision", torchvision.__version__)')), nothing to do"
else
    case "$(uname -m)" in
        aarch64|arm64) torch_pins=(torch==2.9.1 torchvision==0.24.1)
                       size="several GB; several minutes" ;;
        *)             torch_pins=(torch==2.14.1 torchvision==0.29.1)
                       size="about 3 GB to download and 5.5 GB on disk with its CUDA libraries;"
                       size+=" 1 to 9 minutes on a 2-core machine, idle to busy, plus the download" ;;
    esac
    echo "== 1/2 PyTorch: ${torch_pins[*]}, the largest part ($size)"
    run python -m pip install --quiet "${torch_pins[@]}"
    echo "   PyTorch took $((SECONDS - step)) s"
fi

target="."
[ -n "$extras" ] && target=".[$extras]"
step=$SECONDS
if [ -n "$extras" ]; then
    estimate="about 1 to 3 minutes (the extras $extras are the larger part)"
else
    estimate="about 20 to 60 seconds"
fi
echo "== 2/2 actviz $version from $PWD, editable ($target), with what it needs: $packages; $estimate"
# editable_mode=compat puts the clone's folder on sys.path: its actviz/ package then wins over a folder named
# actviz that a script's own folder holds (this clone itself, run from its parent), which a default editable
# install loses to ("module 'actviz' has no attribute 'watch'").
run python -m pip install --quiet --disable-pip-version-check -e "$target" --config-settings editable_mode=compat
echo "   actviz took $((SECONDS - step)) s"
if [ "$dry_run" = 1 ]; then
    echo "== dry run: nothing was installed"
else
    echo "== installed in $((SECONDS - started)) s. Check it with: python -c 'import actviz; print(actviz.__version__)'"
fi

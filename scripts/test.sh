#!/usr/bin/env bash
# Install actviz with its test extras and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev

# The browser test (tests/test_tensorboard_server.py) drives Debian's chromium through
# Playwright; Playwright never downloads a browser of its own. Install chromium when it is
# missing. If that cannot be done, say so loudly and go on: the test then skips, or fails in CI.
install_chromium() {
    [ -x /usr/bin/chromium ] && return 0
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
            as_root=(sudo -n)
        else
            echo "== WARNING: /usr/bin/chromium is missing and we are not root (no password-less sudo): browser test will not run" >&2
            return 0
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "== WARNING: /usr/bin/chromium is missing and there is no apt-get: browser test will not run" >&2
        return 0
    fi
    echo "== installing Debian's chromium for the browser test"
    # Wait for another apt/dpkg rather than fail on its lock.
    local apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=600)
    if ! { "${apt[@]}" update && "${apt[@]}" install -y chromium; } </dev/null >/tmp/actviz_chromium_install.log 2>&1; then
        tail -n 20 /tmp/actviz_chromium_install.log >&2
        echo "== WARNING: installing chromium failed (log: /tmp/actviz_chromium_install.log): browser test will not run" >&2
    fi
}
install_chromium
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

python -m pytest "$@"

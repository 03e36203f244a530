#!/usr/bin/env bash
# Install actviz with its test extras, lint it with ruff and run the whole suite.
# Extra arguments go to pytest; --quick leaves out the slow tests (tests/quick_lane.py).
# CI runs it with no argument: the full suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev

quick=0
for argument in "$@"; do
    [ "$argument" = "--quick" ] && quick=1
done

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
[ "$quick" = 1 ] || install_chromium  # the browser test is not in the quick lane
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

# The cores this process may use: the CPUs it is pinned to, capped by a container's CPU quota.
# PyTorch and OpenMP otherwise start one thread per core of the host, and on a 2-core share of a
# large host the suite then runs several times slower.
cores=$(python - <<'EOF'
import math, os
cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
try:
    quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
    if quota != "max":
        cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
except (OSError, ValueError):
    pass
print(cpus)
EOF
)
# One pytest worker per core (pytest-xdist, at most 8), each with one compute thread: most tests
# are Python-bound, so workers use the cores better than threads do. ACTVIZ_TEST_WORKERS=1 runs
# the suite in one process.
workers=${ACTVIZ_TEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    OMP_NUM_THREADS=$(( cores / workers > 0 ? cores / workers : 1 ))
    export OMP_NUM_THREADS
fi
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist worksteal)
echo "== $workers pytest workers (ACTVIZ_TEST_WORKERS), each with OMP_NUM_THREADS=$OMP_NUM_THREADS"

echo "== ruff check (rules in pyproject.toml)"
lint=0
python -m ruff check . || lint=$?
[ "$lint" = 0 ] || echo "== ruff found the problems above; running the tests all the same" >&2

tests=0
python -m pytest "${parallel[@]}" "$@" || tests=$?
[ "$lint" = 0 ] || echo "== FAILED: ruff check (see above)" >&2
exit $(( tests != 0 ? tests : lint ))

#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, then what a real training step costs (scripts/bench_gpu_step.py)
# with the eager summaries (the default) and the compiled ones (ACTVIZ_FUSED=1). CI has no GPU: this is how those
# paths get run.
#
# Usage: bash scripts/check_gpu.sh [LOG_DIR]     (about five minutes on an H100; logs go to LOG_DIR, default gpu-logs)
# Works without installing actviz (it then runs from this checkout); needs torch with CUDA, torchvision,
# tensorboard, pytest, and transformers for the GPT-2 case. The last lines are the figures: per case, the step
# times and a profiled logging step's host syncs and kernel launches (torch.profiler's tables: LOG_DIR/profile_*).
set -u -o pipefail
cd "$(dirname "$0")/.."
logs=${1:-gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python -c "import actviz" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
python -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name())' || exit 1

echo "== CUDA tests"
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_fused.py tests/test_one_pass.py 2>&1 | tee "$logs/tests.log"
tests=$?

echo "== training steps: bare, watched but idle, logging (eager: the default; fused: ACTVIZ_FUSED=1)"
: >"$logs/bench.log"
for case in "resnet50 --rounds 15" "micro --rounds 30" "gpt2 --rounds 10"; do
    for fused in 0 1; do
        # shellcheck disable=SC2086  # $case is the model and its options
        ACTVIZ_FUSED=$fused timeout 240 python scripts/bench_gpu_step.py --model $case \
            --profile "$logs/profile_${case%% *}_fused$fused.txt" 2>&1 | tee -a "$logs/bench.log"
    done
done

echo "== summary"
tail -n 3 "$logs/tests.log"
grep -h -e " summaries, " -e "^one logging step" "$logs/bench.log"
exit $tests

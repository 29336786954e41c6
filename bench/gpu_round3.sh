#!/usr/bin/env bash
# Issue 10's GPU work in the window while SGLang boots for issue 20 (experiments/h200/grpo_h200.sh), on the same H200:
#   0. $W/HOLD keeps the issue-20 pipeline from starting GRPO until this script is done (GPU memory);
#   1. wait for the issue-20 SFT to finish ($W/SFT_DONE), so nothing here competes with it;
#   2. GPU tests: the fused mHC kernels at real width (final form), the offloaded optimizer and placement, the
#      weight-sync GPU tests incl. the in-process (local) push into a GPU engine (one process at a time; the
#      whole-model MoE tests would hold GRPO back a minute more);
#   3. the `gpu` recipe (bench/gpu_recipe.sh: step split, tokens/s, GPU / host peaks vs the planner; B11),
#      with SGLang resident beside it (64 GiB of the GPU, its JIT compiles on the host CPUs: timings are
#      upper bounds, memory peaks are the recipe's own);
#   4. remove $W/HOLD.
# Detached: setsid nohup bash bench/gpu_round3.sh > /tmp/r3.log 2>&1 &   results in $R3OUT (default /tmp/r3)
set -uo pipefail
W=${H20_WORK:-/tmp/h20}; R3OUT=${R3OUT:-/tmp/r3}; mkdir -p "$R3OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
release() { rm -f "$W/HOLD"; stamp "HOLD released"; touch "$R3OUT/DONE"; }
trap release EXIT
end=$((SECONDS + ${SFT_WAIT_S:-300})); while [ ! -e "$W/SFT_DONE" ] && [ $SECONDS -lt $end ]; do sleep 2; done
stamp "sft done (or waited ${SFT_WAIT_S:-300} s)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
for t in "tests/test_kernels_mhc.py" \
         "tests/test_parallel_optim.py tests/test_actor.py::test_placement_on_cuda tests/test_weight_sync_gpu.py"; do
  timeout 90 python -m pytest -q -p no:cacheprovider -m gpu -rf $t > "$R3OUT/tests.tmp" 2>&1
  echo "[$t] rc $?: $(grep -E 'passed|failed|error' "$R3OUT/tests.tmp" | tail -3 | tr '\n' ' ')" | tee -a "$R3OUT/tests.log"
  grep -E "^FAILED|Error" "$R3OUT/tests.tmp" | head -5 >> "$R3OUT/tests.log"
done
stamp tests
OUT=/tmp/r3_recipe RECIPE_TIMEOUT="${RECIPE_TIMEOUT:-200}" SKIP_TESTS=1 SKIP_OPTIM=1 \
  bash bench/gpu_recipe.sh 2>&1 | grep -v Warn | tail -150 > "$R3OUT/recipe.log"
cp /tmp/r3_recipe/gpu_recipe.json "$R3OUT/" 2>/dev/null
cp /tmp/r3_recipe/run/metrics.jsonl "$R3OUT/recipe_metrics.jsonl" 2>/dev/null
stamp recipe

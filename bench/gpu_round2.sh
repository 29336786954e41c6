#!/usr/bin/env bash
# GPU validation of issues 13 (grouped experts) and 10 (trainer at scale) on one H200, in one call:
#   1. bench/parallel_moe_gemm.py alone (timings): MoE fwd+bwd vs a dense GEMM of the same FLOPs, 768 / 192
#      rows per expert, balanced and skewed routing, and the per-expert loop, same run (docs/benchmarks.md B13);
#   2. correctness, two pytest processes side by side (no timings): tests/test_model_moe_gpu.py (the grouped
#      path vs float64, no host sync, determinism, and the whole `small` model in bf16, modes reference / auto /
#      grouped / triton vs its fp32 run) and the GPU tests of the offloaded optimizer and of placement;
#   3. bench/gpu_recipe.sh (the `gpu` recipe: step split, tokens/s, GPU / host peaks vs the planner; B11);
#   4. bench/bench_optim.py (offloaded AdamW vs torch's fused CPU AdamW, same run; B11), last.
# Each piece under its own `timeout`; results in $OUT (at most 8 files come back from the device).
#   PYTHONPATH=. bash bench/gpu_round2.sh        (about 4.5 minutes on an H200)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_round2}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
stamp() { echo "== $1 done at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "cpus: $(nproc)"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1. MoE benchmark"
timeout "${MOE_BENCH_T:-75}" python bench/parallel_moe_gemm.py --out "$OUT/moe.json" 2>&1 | grep -v Warn
stamp moe_bench

echo "== 2. GPU tests (two processes)"
timeout "${MOE_TEST_T:-120}" python -m pytest -q -s -p no:cacheprovider -m gpu -rf tests/test_model_moe_gpu.py \
  > "$OUT/moe_tests.log" 2>&1 &
p1=$!
timeout 75 python -m pytest -q -p no:cacheprovider -m gpu -rf tests/test_parallel_optim.py \
  "tests/test_actor.py::test_placement_on_cuda" > "$OUT/optim_tests.log" 2>&1 &
p2=$!
wait $p2; echo "optim/placement tests rc $?"; tail -4 "$OUT/optim_tests.log"
wait $p1; echo "moe tests rc $?"; grep -E "MEASURED|passed|failed|Error|error" "$OUT/moe_tests.log" | cut -c1-1500
stamp tests

echo "== 3. gpu recipe"
OUT=/tmp/round2_recipe RECIPE_TIMEOUT="${RECIPE_TIMEOUT:-120}" SKIP_TESTS=1 SKIP_OPTIM=1 \
  bash bench/gpu_recipe.sh 2>&1 | grep -v Warn | tail -120
cp /tmp/round2_recipe/gpu_recipe.json "$OUT/" 2>/dev/null
cp /tmp/round2_recipe/run/metrics.jsonl "$OUT/recipe_metrics.jsonl" 2>/dev/null
stamp recipe

echo "== 4. AdamW rates"
timeout "${OPTIM_T:-45}" python bench/bench_optim.py --billions "${BILLIONS:-0.5}" 2>&1 | tee "$OUT/optim.json"
stamp optim

#!/usr/bin/env bash
# Continuous batching in the embedded engine on one H200, in one call (issue 43 item 5):
#   1. the `gpu` recipe's rollout (8 requests x 8 samples x 16 tokens through HTTP, FP8 engine) on one engine:
#      serial + exact scoring (the engine before) vs continuous batching with batched / exact scoring, tokens/s,
#      forwards per round, the same-seed agreement (bench/bench_rollout.py --part batching); with the engine
#      module of the commit before (OLD_ENGINE, default bench/old_engine.py if present) as one more mode;
#   2. where one decode / scoring forward's launches go, the decode forward on the reference path and on the
#      decode seam (model.decode_kernels: fused mHC, dense experts, the one-token step's fused norms / rope /
#      attention), device kernels and host syncs (--part launches);
#   3. the GPU tests: batched vs serial samples and log-probs, the decode seam vs the reference (logits, kernels)
#      (tests/test_rollout_batching.py -m gpu), the step kernels vs their references (tests/test_decode_kernels.py -m gpu).
#   git show 8c3148f:nanoflash/server/engine.py > bench/old_engine.py   # optional, untracked: travels with the tree
#   bash bench/gpu_batching.sh          (about 2 minutes on an H200, 3 with the old engine; results in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_batching}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "cpus: $(nproc)"
OLD=${OLD_ENGINE:-bench/old_engine.py}
OLD_ARG=(); [ -f "$OLD" ] && OLD_ARG=(--old-engine "$OLD")
t0=$(date +%s)
timeout 300 python bench/bench_rollout.py --part batching "${OLD_ARG[@]}" --out "$OUT/batching.json" 2>&1 | tail -8
echo "batching: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python bench/bench_rollout.py --part launches --out "$OUT/launches.json" 2>&1 | grep -v USDT | tail -2
echo "launches: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 180 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_rollout_batching.py tests/test_decode_kernels.py \
    2>&1 | tail -8
echo "test: $(( $(date +%s) - t0 )) s"

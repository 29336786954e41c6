#!/usr/bin/env bash
# The GPU trainer on one H200: GPU-marked placement tests, then `torchrun --nproc-per-node 1 train.py --recipe
# smoke` with a real one-rank NCCL process group (torchrun sets WORLD_SIZE, so init_distributed creates it),
# in three precisions. Prints where the weights and optimizer state live, per-step times and GPU memory.
#   bash bench/gpu_trainer.sh            (about 3 minutes on an H200; results also in $OUT if set)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_trainer}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q -p no:cacheprovider -m gpu tests/test_actor.py 2>&1 | tail -5
run() {  # name, extra flags
  local name=$1; shift
  local t0=$(date +%s.%N)
  torchrun --nproc-per-node 1 --master-port 29733 train.py --recipe smoke --out "/tmp/run_$name" \
    --train.progress false --train.plots false --train.threads 4 "$@" 2>&1 | grep -v Warning | tail -8
  echo "$name: wall $(python -c "import time; print(f'{time.time() - $t0:.1f}')") s"
  python - "$name" <<'PY'
import json, sys
name = sys.argv[1]
recs = [json.loads(l) for l in open(f"/tmp/run_{name}/metrics.jsonl")]
info = next(r for r in recs if r["kind"] == "info")
for r in recs:
    if r["kind"] == "train":
        print(f"  {name} step {r['step']}: step_s {r['step_s']:.2f} rollout_s {r['rollout_s']:.2f} "
              f"train_s {r.get('train_s', float('nan')):.3f} sync_s {r.get('sync_s', float('nan')):.3f} "
              f"|dlogp| {r.get('train_rollout_logprob_abs_diff', float('nan')):.3e} "
              f"gpu_mem {r.get('gpu_mem_gib', float('nan')):.4f} GiB peak {r.get('gpu_peak_gib', float('nan')):.4f} GiB")
PY
  cp "/tmp/run_$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null
}
run fp8                                        # bf16-free default: fp32 trainer, FP8 embedded engine
run matched --rollout.weights fp32             # fp32 trainer + fp32 engine on the same GPU
run bf16_offload --train.dtype bf16 --parallel.offload_optimizer true
python - <<'PY'
import torch, dataclasses
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.parallel.dims import init_distributed
from nanoflash.rl import trainer
cfg = parse_args(["--recipe", "smoke", "--train.dtype", "bf16"])
dims = init_distributed()
actor = trainer.Actor(cfg, preset("tiny", **cfg.model), dims)
opt = actor.start_optimizer()
devs = {str(t.device) for _, t in actor.state_iter()} | {str(v.device) for st in opt.state.values() for v in st.values()}
print("placement: state + optimizer devices", devs, "dtypes", {str(p.dtype) for p in actor.model.parameters()})
PY

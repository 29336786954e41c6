#!/usr/bin/env bash
# The whole nanoflash <-> live SGLang 0.5.16 check on one H200 (issue 6), after the three package pieces of
# ../shared/sglang-h200/ were copied to /tmp/acc by three back-to-back device runs (see docs/sglang.md):
#   bash experiments/h200/sglang_h200.sh all      # install, write the small checkpoint, serve it, parity, two pushes
#   bash experiments/h200/sglang_h200.sh distributed   # (installed) 4-layer checkpoint, serve, 3 gloo group pushes
# Outputs land in ${OUT:-/tmp/out}: parity.json, push.json, server logs.
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$R PATH=/tmp/site/bin:$PATH
export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
# FP8 experts, BF16 wo_a (Miles' settings); no tilelang mHC pre kernel (removes the 450 s first-push compile).
export SGLANG_DSV4_FP4_EXPERTS=0 SGLANG_OPT_FP8_WO_A_GEMM=0 SGLANG_OPT_USE_TILELANG_MHC_PRE=0 PYTHONUNBUFFERED=1
CKPT=/tmp/nf_small

install() {
  (cd /tmp/acc && sha256sum -c SHA256SUMS) || exit 1
  cat /tmp/acc/sgl0516_lean.tar.xz.part* | python3 -c \
    "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site', filter='tar')"
}
serve() {
  python3 "$R/experiments/h200/sglang_check.py" ckpt --dir $CKPT || exit 1
  setsid nohup python3 -m sglang.launch_server --model-path $CKPT --load-format auto --tp 1 --disable-cuda-graph \
    --skip-server-warmup --skip-tokenizer-init --mem-fraction-static 0.6 --port 30000 > /tmp/server.log 2>&1 &
}
check() {
  python3 "$R/experiments/h200/sglang_check.py" parity --dir $CKPT --out "$OUT/parity.json" --wait 450
  python3 "$R/experiments/h200/sglang_check.py" push --dir $CKPT --out "$OUT/push.json"
  cp /tmp/server.log "$OUT/server.log"
}
distributed() {   # issue 36 item 8: the gloo update-group push, `small` cut to 4 layers, within one 10-minute command
  export NF_CHECK_PRESET=h200 NF_URL=http://127.0.0.1:30000
  python3 -c "import torch, sglang; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'sglang', sglang.__version__)"
  python3 "$R/experiments/h200/sglang_check.py" ckpt --dir /tmp/nf_h200 || exit 1
  setsid nohup python3 -m sglang.launch_server --model-path /tmp/nf_h200 --load-format auto --tp 1 --disable-cuda-graph \
    --skip-server-warmup --skip-tokenizer-init --mem-fraction-static 0.6 --port 30000 > "$OUT/server.log" 2>&1 &
  timeout $((580 - SECONDS)) python3 "$R/experiments/h200/sglang_check.py" push --dir /tmp/nf_h200 --transport distributed \
    --backend gloo --pushes 3 --wait 480 --join-timeout 240 --out "$OUT/push_distributed.json" > "$OUT/push.log" 2>&1
  echo "push rc=$? at ${SECONDS}s"
}
case "${1:-all}" in
  install) install ;; serve) serve ;; check) check ;; distributed) distributed ;;
  all) install && serve && check ;;
  *) echo "usage: $0 install|serve|check|all|distributed" >&2; exit 2 ;;
esac

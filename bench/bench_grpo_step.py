"""train.py's GRPO step, measured: the trainer's old-log-prob pass, forward + backward, optimizer, on one GPU at
the long-context experiment's shapes, as MFU next to the layer stack's (bench_stack.py), with the time outside
GPU kernels (packing, host syncs, launches, Python) from a profiler trace.

    python bench/bench_grpo_step.py --out grpo_step.json                  # one H200, ~2 min
    python bench/bench_grpo_step.py --preset tiny --device cpu --dtype fp32 --prompt-len 20,40 \\
        --response-len 2,8 --prompts 2 --samples 2 --steps 1 --warmup 0   # CPU smoke (tests/test_bench_grpo_step.py)

What runs: the model of `--recipe` (default experiments/h200/h200.txt: `small`'s geometry cut to 4 layers,
0/4/128/4, bf16) with `--model.kernels auto` as the long run uses it (Triton attention, indexer and grouped MoE;
eager mHC; fp32 head), built by `rl.trainer.Trainer` exactly as train.py builds it (seeded init, AdamW with the
FP8 push's served storage). A synthetic `grpo.RolloutBatch` of `--prompts` x `--samples` sequences: each prompt
`--prompt-len` tokens (uniform, default 2,048-3,000: the far class of experiments/h200/longctx.py), each
response `--response-len` tokens (default 8-64; the cap is 64), random tokens, rewards 0/1, group advantages.
One step = `Trainer.logprobs` (old log-probs, forward only) then `Trainer.train` (1F1B forward + backward on
token-budget micro-batches, clip, AdamW, the finite-weight check), each CUDA-synchronised; fwd_bwd is train
minus the optimizer (`AdamW.last_step_s`) and the finite check (timed alone). Packing (`Trainer.micro_batches`)
is timed alone too; it runs inside both passes.

MFU = model FLOPs / time / 989 TFLOP/s (bf16 datasheet), as bench_stack.py; `ratio_to_ceiling` divides by the
bf16 matmul ceiling measured in the same run (8192^3). Model FLOPs per sequence of L positions with R scored:
L x `bench_model.model_flops_per_token(cfg, L)` (matmul weights and the attention V4 does, causal) less the head
at the L - R unscored positions (RL needs logits at the response tokens only); the old-log-prob pass is 1x
forward, train 3x. `mfu_6nd` is the brief form: 6 N_active x real tokens / train time (N_active: the matmul
weights a token touches, head included). Padding counts against both (micro-batches are padded to their longest).

Profile (`torch.profiler`, one more step): GPU busy = the union of the device events' intervals; the rest of
the step's wall time is time outside kernels, listed as the largest GPU-idle gaps with the innermost CPU op
running at each (aten::nonzero / item / _local_scalar_dense / to = a host sync; "python" = no op at all),
plus counts of kernel launches, synchronisations and copies, and the top CPU ops by self time.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import DATASHEET_BF16, matmul_ceiling, model_flops_per_token  # noqa: E402

from nanoflash import grpo  # noqa: E402
from nanoflash.cli import parse_args  # noqa: E402
from nanoflash.config import run_preset  # noqa: E402
from nanoflash.model import Transformer  # noqa: E402
from nanoflash.parallel.dims import ParallelDims  # noqa: E402
from nanoflash.rl.trainer import FIELDS, Trainer  # noqa: E402
from nanoflash.sglang.buckets import optimizer_storage  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "experiments", "h200", "h200.txt")
SYNC_OPS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::_to_copy",
            "aten::copy_", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
GAPS_LISTED = 12


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def run_config(a):
    """The recipe's RunConfig with the bench's overrides (device, dtype, kernels, preset, layers, budget)."""
    args = ["--recipe", a.recipe, "--model.kernels", a.kernels, "--parallel.device", a.device,
            "--grpo.n_prompts", str(a.prompts), "--grpo.group_size", str(a.samples)]
    args += ["--train.preset", a.preset] if a.preset else []
    args += ["--train.dtype", a.dtype] if a.dtype else []
    args += ["--parallel.micro_batch_tokens", str(a.micro_batch_tokens)] if a.micro_batch_tokens else []
    cfg = parse_args(args)
    if a.layers:
        ratios = run_preset(cfg).compress_ratios
        cfg.model.update(n_layers=a.layers, n_mtp_layers=0, compress_ratios=tuple(ratios[:a.layers]))
    return cfg


def synth_batch(cfg, mcfg, a) -> grpo.RolloutBatch:
    """`prompts` groups of `samples` random sequences at the requested lengths, rewards 0/1 in every group."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    eps = []
    for gid in range(a.prompts):
        P = rng.randint(*a.prompt_len)
        prompt = torch.randint(1, mcfg.vocab_size, (P,), generator=g).tolist()
        for j in range(a.samples):
            R = rng.randint(*a.response_len)
            resp = torch.randint(1, mcfg.vocab_size, (R,), generator=g).tolist()
            lp = (-torch.rand(R, generator=g) * 3).tolist()
            eps.append(grpo.Episode(prompt, resp, lp, float((j + gid) % 2), gid))
    return grpo.pack(eps, grpo.episode_advantages(eps, a.samples))


def active_matmul_params(mcfg) -> int:
    """N_active: the matmul weights one token touches (as `model_flops_per_token` counts them: 2-D weights but
    embedding, MTP and routed experts; plus the top-k routed experts), the head included."""
    with torch.device("meta"):
        m = Transformer(mcfg)
    mats = sum(p.numel() for n, p in m.named_parameters()
               if p.dim() == 2 and not n.startswith(("mtp.", "embed.")) and ".experts." not in n)
    return mats + mcfg.n_layers * mcfg.n_activated_experts * 3 * mcfg.dim * mcfg.moe_inter_dim


def model_flops(mcfg, batch) -> dict:
    """Forward model FLOPs of the batch's real positions (the head at the scored ones only), its tokens."""
    lens = (batch.prompt_lens + batch.response_lens - 1).tolist()
    scored = batch.mask.sum(1).tolist()
    per_len = {L: model_flops_per_token(mcfg, L) for L in set(lens)}
    head = 2 * mcfg.vocab_size * mcfg.dim
    fwd = sum(L * per_len[L] - head * (L - R) for L, R in zip(lens, scored))
    return {"fwd": fwd, "tokens": sum(lens), "scored": sum(scored), "n_active": active_matmul_params(mcfg)}


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def one_step(trainer, batch, dev) -> dict:
    """old log-probs, then train (fwd+bwd, clip, AdamW, finite check); seconds of each, CUDA-synchronised."""
    out = {}
    sync(dev)
    t0 = time.perf_counter()
    with record_function("bench/old_logprobs"):
        old = trainer.logprobs(batch)
    sync(dev)
    out["old_logprobs_s"] = time.perf_counter() - t0
    batch.old_logprobs = old
    t1 = time.perf_counter()
    with record_function("bench/train"):
        m = trainer.train(batch)
    sync(dev)
    out["train_s"] = time.perf_counter() - t1
    out["optimizer_s"] = trainer.optimizer.last_step_s
    out["loss"] = m["loss"]
    return out


def finite_check_s(trainer, dev) -> float:
    sync(dev)
    t = time.perf_counter()
    trainer.require_finite("bench")
    sync(dev)
    return time.perf_counter() - t


def packing_s(trainer, batch) -> float:
    t = time.perf_counter()
    trainer.micro_batches(batch, trainer._fields("old_logprobs"))
    return time.perf_counter() - t


def idle_gaps(dev: list, t0: float, t1: float) -> tuple[float, list]:
    """GPU busy time in [t0, t1] (µs, the union of device intervals) and the idle gaps (µs, start, end),
    largest first."""
    iv = sorted((max(s, t0), min(e, t1)) for s, e in dev if e > t0 and s < t1)
    busy, gaps, cur = 0.0, [], t0
    for s, e in iv:
        if s > cur:
            gaps.append((s - cur, cur, s))
        if e > cur:
            busy += e - max(s, cur)
            cur = e
    if t1 > cur:
        gaps.append((t1 - cur, cur, t1))
    return busy, sorted(gaps, reverse=True)


def ops_at(cpu: list, times) -> dict:
    """For each time t, the CPU ops running then (every thread's open nest), swept once in start order.
    cpu: (start, end, name, thread) µs."""
    evs, res, stacks, i = sorted(cpu, key=lambda x: (x[0], -x[1])), {}, {}, 0
    for t in sorted(times):
        while i < len(evs) and evs[i][0] <= t:
            st = stacks.setdefault(evs[i][3], [])
            while st and st[-1][1] <= evs[i][0]:
                st.pop()
            st.append(evs[i])
            i += 1
        cover = []
        for st in stacks.values():
            while st and st[-1][1] < t:
                st.pop()
            cover += st
        res[t] = cover
    return res


def label(cover: list) -> str:
    """'phase: innermost op' of the ops open at one time ("python" = no op: interpreter time)."""
    phase = next((x[2] for x in sorted(cover) if x[2].startswith("bench/") and x[2] != "bench/step"), "")
    ops = [x for x in cover if not x[2].startswith("bench/")]
    inner = max(ops, key=lambda x: (x[0], -x[1]))[2] if ops else "python"
    return f"{phase}: {inner}" if phase else inner


def self_cpu_us(cpu: list) -> dict:
    """Self time per op name (duration less the direct children's), per thread's nest."""
    out, threads = {}, {}
    for ev in cpu:
        threads.setdefault(ev[3], []).append(ev)
    for evs in threads.values():
        stack = []
        for s, e, n, _ in sorted(evs, key=lambda x: (x[0], -x[1])) + [(float("inf"), float("inf"), "", 0)]:
            while stack and stack[-1][1] <= s:
                ps, pe, pn, child = stack.pop()
                out[pn] = out.get(pn, 0.0) + (pe - ps) - child
                if stack:
                    stack[-1][3] += pe - ps
            stack.append([s, e, n, 0.0])
    return out


def profile_step(trainer, batch, dev) -> dict:
    """One more step under torch.profiler, read from kineto's raw events (fast at ~10^5 events)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("bench/step"):
            one_step(trainer, batch, dev)
    cpu, device = [], []
    for e in prof.profiler.kineto_results.events():
        s = e.start_ns() / 1e3
        if e.device_type() == torch.autograd.DeviceType.CPU:
            cpu.append((s, s + e.duration_ns() / 1e3, e.name(), e.start_thread_id()))
        else:
            device.append((s, s + e.duration_ns() / 1e3))
    t0, t1 = next((s, e) for s, e, n, _ in cpu if n == "bench/step")
    out = {"wall_ms": (t1 - t0) / 1e3, "device_events": len(device)}
    if device:
        busy, gaps = idle_gaps(device, t0, t1)
        big = [g for g in gaps if g[0] > 50]                      # gaps over 50 µs, by the op running then
        at = ops_at(cpu, [(s + e) / 2 for _, s, e in big])
        by_op = {}
        for g, s, e in big:
            k = label(at[(s + e) / 2])
            by_op[k] = by_op.get(k, 0.0) + g / 1e3
        top = sorted(((k, round(v, 3)) for k, v in by_op.items()), key=lambda kv: -kv[1])[:GAPS_LISTED]
        out.update(gpu_busy_ms=busy / 1e3, outside_kernels_ms=(t1 - t0 - busy) / 1e3,
                   outside_kernels_frac=(t1 - t0 - busy) / (t1 - t0), gaps_over_1ms=sum(g[0] > 1e3 for g in gaps),
                   gaps_over_50us_ms=sum(g[0] for g in big) / 1e3, gap_ms_by_op=dict(top),
                   largest_gaps=[{"ms": round(g / 1e3, 3), "at": label(at[(s + e) / 2])}
                                 for g, s, e in big[:GAPS_LISTED]])
    names = {}
    for _, _, n, _ in cpu:
        names[n] = names.get(n, 0) + 1
    out["launches"] = sum(names.get(n, 0) for n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                    "cuLaunchKernelEx"))
    out["syncs"] = {n: names[n] for n in SYNC_OPS if n in names}
    selft = sorted(self_cpu_us([x for x in cpu if not x[2].startswith("bench/")]).items(), key=lambda kv: -kv[1])
    out["top_self_cpu_ms"] = {k: round(v / 1e3, 2) for k, v in selft[:GAPS_LISTED]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--preset", default="", help="override train.preset (tiny for the CPU smoke)")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to its first N layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="", help="override train.dtype (fp32 | bf16)")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=span, default=(2048, 3000))
    ap.add_argument("--response-len", type=span, default=(8, 64))
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="override parallel.micro_batch_tokens")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel compiles)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (mean)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t_start, dev = time.time(), a.device
    cfg = run_config(a)
    mcfg = run_preset(cfg)
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               torch=torch.__version__, recipe=os.path.relpath(a.recipe, ROOT), preset=cfg.train.preset,
               layers=list(mcfg.compress_ratios[:mcfg.n_layers]), dtype=cfg.train.dtype, kernels=mcfg.kernels,
               micro_batch_tokens=cfg.parallel.micro_batch_tokens, prompts=a.prompts, samples=a.samples,
               prompt_len=a.prompt_len, response_len=a.response_len)
    ceiling = matmul_ceiling() if dev == "cuda" else 1e12
    res["matmul_ceiling_tflops"] = ceiling / 1e12
    trainer = Trainer(cfg, mcfg, ParallelDims(), served_storage=optimizer_storage(cfg, mcfg))
    trainer.start_optimizer()
    res["params"] = sum(p.numel() for p in trainer.model.parameters())
    res["build_s"] = time.time() - t_start
    batch = synth_batch(cfg, mcfg, a)
    fl = model_flops(mcfg, batch)
    mbs, _ = trainer.micro_batches(batch, FIELDS)
    padded = sum(mb["input_ids"].numel() for mb in mbs)
    res.update(sequences=len(batch), tokens=fl["tokens"], scored_tokens=fl["scored"], micro_batches=len(mbs),
               padded_tokens=padded, padding_frac=1 - fl["tokens"] / padded, fwd_tflop=fl["fwd"] / 1e12)
    for _ in range(a.warmup):
        one_step(trainer, batch, dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = [one_step(trainer, batch, dev) for _ in range(a.steps)]
    t = {k: statistics.mean(r[k] for r in runs) for k in ("old_logprobs_s", "train_s", "optimizer_s")}
    t["finite_check_s"] = finite_check_s(trainer, dev)
    t["packing_s"] = packing_s(trainer, batch)
    t["fwd_bwd_s"] = t["train_s"] - t["optimizer_s"] - t["finite_check_s"]
    t["step_s"] = t["old_logprobs_s"] + t["train_s"]
    F = fl["fwd"]
    res["time_s"] = t
    passes = (("step", 4), ("old_logprobs", 1), ("fwd_bwd", 3))   # forwards' worth of FLOPs in each
    res["mfu"] = {k: n * F / t[f"{k}_s"] / DATASHEET_BF16 for k, n in passes}
    res["ratio_to_ceiling"] = {k: v * DATASHEET_BF16 / ceiling for k, v in res["mfu"].items()}
    res["mfu_6nd_fwd_bwd"] = 6 * fl["n_active"] * fl["tokens"] / t["fwd_bwd_s"] / DATASHEET_BF16
    res["tokens_per_s"] = fl["tokens"] / t["step_s"]
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else 0.0
    res["loss"] = runs[-1]["loss"]
    if not a.no_profile:
        try:
            res["profile"] = profile_step(trainer, batch, dev)
        except Exception as e:  # noqa: BLE001 -- a benchmark records the failure and keeps its timings
            res["profile"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    res["elapsed_s"] = time.time() - t_start
    print(json.dumps(res, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

"""The V4 layer stack at real geometry on one GPU: forward + backward of 8 layers at real width with the head,
as MFU, HFU and the ratio to the bf16 matmul ceiling measured in the same run; per-component split; peak memory.

    python bench/bench_stack.py --out stack.json            # on an H200 (~2-3 min)
    python bench/bench_stack.py --jobs none,selective,full,planner --out recompute.json   # recompute only (~2 min)

Geometry (issue 14): the flash config cut to 8 layers -- dim 4096, 64 heads x 512 (one shared K=V head),
window 128, index_topk 512, layers (0, 0, 4, 128, 4, 128, 4, 128) as the flash schedule starts (2 sliding,
3 C4, 3 C128; the first 3 hash-routed), 64 experts of 2048, top-6, one shared expert (8192 x 6 / 64 = 768 rows
per expert: what one GPU holds at EP4), full vocabulary head, S = 8192, batch 1, bf16 weights.

Model FLOPs (analytic, `bench_model.model_flops_per_token`; forward, per token, averaged over t = 0..S-1):
    2 x (active matmul weights: attention projections, indexer wq_b / weights_proj, compressors, gate,
         shared + top-6 routed experts (3 D I each), mHC fn [24, 4D] per sublayer, hc_head, head)
  + attention: 4 H Dh x keys(t),  keys = min(W, t+1) + (C4: min(index_topk, (t+1)//4) | C128: (t+1)//128)
  + indexer: 2 HI dI x (t+1)//4 on C4 layers (every visible entry, causal)
Training = 3 x forward. Check: the full flash config at S = 4096 gives 28.52 GFLOP/token (the 43 layers and
the head, causal indexer, no MTP), the issue's 28.5; MTP adds 1.78 (its block 0.71 + the shared head 1.06).
HFU adds what the step really runs on top: the recomputed forward of every layer (recompute=full) or of the
recomputed sub-blocks' GEMMs (`recompute_flops_per_token`: the mHC mixes for mhc, wq_b for attn_q, wo_a + wo_b
for attn_out, the routed experts for experts; norms and SwiGLU are elementwise), and the head's logits
recomputed in the chunked log-prob backward (always). None of it is a model FLOP.

Recompute policies (`ParallelConfig.recompute`, jobs none / selective / full): step time, MFU, HFU, peak memory
and the activations the layers keep after their forward (memory_allocated after `run_layers` minus before it,
less its output); the job
`planner` compares the planner's prediction of those bytes (`planner.stage_act_bytes` with fits measured here on
one block of this geometry, `measure_layer_bytes` at S/2 and S) with them.

Split: each component timed alone (forward + backward, one layer of each kind on the same inputs) and
multiplied by its count: attention core (= Attention minus its compressors and indexer), compressor, indexer
(forward only: top-k has no gradient), MoE, mHC (hc_pre + hc_post, 2 per layer), head (hc_head + norm +
chunked log-probs). The sum is printed next to the measured step.
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import DATASHEET_BF16, matmul_ceiling, model_flops_per_token  # noqa: E402

from nanoflash.config import preset, recompute_blocks  # noqa: E402
from nanoflash.model import Transformer, hc_head  # noqa: E402
from nanoflash.parallel.planner import measure_layer_bytes, stage_act_bytes  # noqa: E402

LAYERS = (0, 0, 4, 128, 4, 128, 4, 128)
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: the --smoke run only (tiny config)


def timed(fn, iters=3, warmup=1):
    """Median seconds of fn() (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if DEV == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def stack_config(kernels: str, n_layers: int = 8, smoke: bool = False):
    if smoke:
        return preset("tiny", kernels=kernels)
    return preset("flash", n_layers=n_layers, n_mtp_layers=0, n_routed_experts=64,
                  compress_ratios=LAYERS[:n_layers], kernels=kernels)


@torch.no_grad()
def build(cfg):
    """bf16 model straight on the GPU (meta -> to_empty, random fill on the device: the CPU init of 14B
    parameters would take minutes)."""
    with torch.device("meta"):
        m = Transformer(cfg).cast_(torch.bfloat16)
    m = m.to_empty(device=DEV)
    m.init_weights(generator=torch.Generator(device=DEV).manual_seed(0))   # init_weights' rules, drawn on the GPU
    return m.train()


def step_fn(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        (-model.token_logprobs(ids, torch.roll(ids, -1, 1)).mean()).backward()
    return step


def recompute_flops_per_token(cfg, recompute) -> float:
    """GEMM FLOPs per token that backward recomputes under a sub-block policy (all layers; "layer" not here)."""
    blocks, D, M, H = recompute_blocks(recompute), cfg.dim, cfg.hc_mult, cfg.n_heads * cfg.head_dim
    per_layer = {"mhc": 2 * (2 * (2 + M) * M * M * D + 2 * M * M * D),      # 2 sublayers: mixes + hc_post's mix
                 "attn_q": 2 * cfg.q_lora_rank * H,
                 "attn_out": 2 * H * cfg.o_lora_rank + 2 * cfg.o_groups * cfg.o_lora_rank * D,
                 "experts": 2 * cfg.n_activated_experts * 3 * D * cfg.moe_inter_dim}
    return cfg.n_layers * sum(per_layer.get(b, 0) for b in blocks)


def measure_step(model, ids, recompute: str, ceiling: float, S: int):
    cfg = model.cfg
    model.recompute = recompute
    step = step_fn(model, ids)
    step()   # warm-up (kernel compiles) before the memory counts
    model.zero_grad(set_to_none=True)
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        h = model.run_layers(model.embed_streams(ids), ids)
        torch.cuda.synchronize()   # what the layers' forward leaves for backward (their output excluded)
        kept = torch.cuda.memory_allocated() - base - h.untyped_storage().nbytes()
        fast = cfg.kernels == "triton"   # the head token_logprobs runs (bf16 GEMMs, fp32 logits)
        (-model.head_logprobs(h, torch.roll(ids, -1, 1), fast=fast).mean()).backward()
        del h
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sec = timed(step, iters=3, warmup=0)
    fwd = model_flops_per_token(cfg, S) * S
    layers_fwd = fwd - 2 * cfg.vocab_size * cfg.dim * S                  # the head is not recomputed per layer
    model_f = 3 * fwd
    again = layers_fwd if "layer" in recompute_blocks(recompute) else recompute_flops_per_token(cfg, recompute) * S
    hw_f = model_f + again + 2 * cfg.vocab_size * cfg.dim * S
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if DEV == "cuda" else 0.0
    return dict(recompute=recompute, step_s=sec, tokens_per_s=S / sec, model_tflop=model_f / 1e12,
                mfu=model_f / sec / DATASHEET_BF16, hfu=hw_f / sec / DATASHEET_BF16,
                ratio_to_ceiling=model_f / sec / ceiling, peak_gib=peak,
                acts_after_fwd_gib=kept / 2 ** 30 if DEV == "cuda" else 0.0)


def planner_check(model, S: int, res: dict):
    """The planner's activations kept after the forward (fits of one block of this geometry, measured here at S/2
    and S, none and selective) next to the measured `acts_after_fwd_gib` of the jobs that ran."""
    cfg, out = model.cfg, {}
    fits = {p: measure_layer_bytes(cfg, (S // 2, S), dtype=torch.bfloat16, device=DEV, recompute=p)
            for p in ("none", "selective")}
    for job, policy in (("none", "none"), ("selective", "selective"), ("full", "full")):
        kept, _ = stage_act_bytes(cfg, policy, range(cfg.n_layers), S, fits["none"], fits.get(policy), S, 2)
        measured = res.get(job, {}).get("acts_after_fwd_gib") if isinstance(res.get(job), dict) else None
        out[policy] = dict(planner_gib=kept / 2 ** 30, measured_gib=measured)
    out["fits"] = {p: {str(r): [round(a), round(b, 2)] for r, (a, b) in f.items()} for p, f in fits.items()}
    return out


def measure_auto(model, ids, ceiling, S):
    """The same model on kernels="auto" (attention + indexer kernels only: eager mHC, fp32 head / gate /
    compressor GEMMs, the per-expert MoE loop) -- what this issue's kernels replace. cfg is shared by every
    module, so one attribute switches them all."""
    kernels, model.cfg.kernels = model.cfg.kernels, "auto"
    try:
        return measure_step(model, ids, "none", ceiling, S)
    finally:
        model.cfg.kernels = kernels


def fb(fn, x):
    """fwd+bwd seconds of fn(x) (grads of the module parameters and x) against a fixed cotangent made once."""
    first = lambda: (lambda y: y[0] if isinstance(y, tuple) else y)(fn(x))   # noqa: E731
    dy = torch.ones_like(first())

    def run():
        first().backward(dy)
    return timed(run, iters=2, warmup=1)


def components(model, S: int):
    cfg, dev = model.cfg, DEV
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, S, cfg.dim, device=dev, generator=g).bfloat16().requires_grad_()
    h = torch.randn(1, S, cfg.hc_mult, cfg.dim, device=dev, generator=g).bfloat16().requires_grad_()
    ids = torch.randint(0, cfg.vocab_size, (1, S), device=dev, generator=g)
    out, per_kind = {}, {}
    for lid, r in enumerate(cfg.compress_ratios[:cfg.n_layers]):
        if r in per_kind:
            continue
        a = model.layers[str(lid)].attn
        t = {"total": fb(lambda v: a(v), x)}
        t["compressor"] = fb(lambda v: a.compressor(v, 0)[0], x) if r else 0.0
        if r == 4:
            with torch.no_grad():
                qr = a.q_norm(a.wq_a(x))
                t["indexer"] = timed(lambda: a.indexer(x, qr, 0, None, None, fast=dev == "cuda"), iters=2, warmup=1)
        per_kind[r] = t
    counts = {r: cfg.compress_ratios[:cfg.n_layers].count(r) for r in per_kind}
    out["compressor"] = sum(counts[r] * t["compressor"] for r, t in per_kind.items())
    out["indexer"] = sum(counts[r] * t.get("indexer", 0.0) for r, t in per_kind.items())
    out["attention"] = sum(counts[r] * t["total"] for r, t in per_kind.items()) - out["compressor"] - out["indexer"]
    blk = model.layers[str(cfg.n_layers - 1)]
    out["moe"] = cfg.n_layers * fb(lambda v: blk.ffn(v, ids), x)
    fused = cfg.kernels == "triton"
    from nanoflash.model import hc_post
    post_fn = hc_post
    if fused:
        from nanoflash.kernels.mhc import hc_post_fused as post_fn

    def mhc(v):
        y, post, comb = blk.hc_pre(v, blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base, fused)
        return post_fn(y * 1.5, v, post, comb)
    out["mhc"] = 2 * cfg.n_layers * fb(mhc, h)

    def head(v):
        y = model.norm(hc_head(v, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, cfg))
        from nanoflash.model import chunked_logprobs
        return chunked_logprobs(y, model.head.weight, ids, 1.0, 1024, fused and y.is_cuda)
    out["head"] = fb(head, h)
    out["sum"] = sum(out.values())
    out["per_attention_kind"] = {str(r): t for r, t in per_kind.items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kernels", default="triton")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds; skip what would start after it")
    ap.add_argument("--jobs", default="none,selective,full,split_s,auto_no_recompute",
                    help="comma list of: none, selective, full (recompute policies), split_s, auto_no_recompute, "
                         "planner, or any sub-block list of ParallelConfig.recompute joined by + (mhc+attn_q)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny config (CPU ok): checks the script runs")
    a = ap.parse_args()
    t0 = time.time()
    cfg = stack_config(a.kernels, a.layers, a.smoke)
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
               torch=torch.__version__, seq=a.seq, layers=cfg.compress_ratios[:cfg.n_layers], kernels=a.kernels)

    def save():
        print(json.dumps(res, indent=1), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    ceiling = matmul_ceiling() if DEV == "cuda" else 1e12
    res["matmul_ceiling_tflops"] = ceiling / 1e12
    res["gflop_per_token_fwd"] = model_flops_per_token(cfg, a.seq) / 1e9
    res["flash_s4096_gflop_per_token_fwd"] = model_flops_per_token(preset("flash"), 4096) / 1e9
    model = build(cfg)
    res["params"] = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device=DEV)
    named = {"split_s": lambda: components(model, a.seq), "auto_no_recompute": lambda: measure_auto(model, ids, ceiling,
                                                                                                   a.seq),
             "planner": lambda: planner_check(model, a.seq, res)}
    jobs = [(name, named.get(name, lambda p=name: measure_step(model, ids, p.replace("+", ","), ceiling, a.seq)))
            for name in a.jobs.split(",")]   # a policy list inside --jobs: sub-blocks joined by "+" (mhc+attn_q)
    for name, job in jobs:
        if time.time() - t0 > a.deadline:
            res[name] = "skipped: deadline"
            continue
        try:
            res[name] = job()
        except Exception as e:  # noqa: BLE001 -- a benchmark records the failure and goes on
            res[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        model.zero_grad(set_to_none=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
        res["elapsed_s"] = time.time() - t0
        save()


if __name__ == "__main__":
    main()

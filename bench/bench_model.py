"""Forward+backward throughput of the `small` preset in bf16 on one GPU, as MFU and as a ratio to the measured
bf16 matmul ceiling, plus where the time goes (attention / compressor / indexer, MoE, mHC).

    python bench/bench_model.py --seq 8192 --batch 1            # on an H200
    python bench/bench_model.py --preset tiny --seq 256          # smoke test on CPU

Model FLOPs are counted analytically (no measured-op counting): 2 x (active matmul weights) per token, plus the
attention that V4 actually does -- q.k and p.v over the min(W, t+1) window keys and the entries each query keeps
(C4: min(index_topk, (t+1)//4), C128: (t+1)//128) -- plus the indexer's q.k over all visible C4 entries.
Training = 3 x forward. The dense masked attention of model.py computes more than this (every key of the chunk
and every compressed entry, masked): that overhead counts against MFU, as it should.
"""
import argparse
import json
import math
import time

import torch

from nanoflash.config import preset
from nanoflash.model import Transformer, hc_post

DATASHEET_BF16 = 989e12


def model_flops_per_token(cfg, S: int) -> float:
    """Forward FLOPs per token averaged over positions 0..S-1 (backbone only, no MTP)."""
    D, E, K, I = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts, cfg.moe_inter_dim
    with torch.device("meta"):
        m = Transformer(cfg)
    mats = sum(p.numel() for n, p in m.named_parameters()
               if p.dim() == 2 and not n.startswith(("mtp.", "embed.")) and ".experts." not in n)
    mats += cfg.n_layers * K * 3 * D * I                                    # active routed experts
    t = torch.arange(S, dtype=torch.float64)
    win = torch.clamp(t + 1, max=cfg.window_size)
    attn = 0.0
    for r in cfg.compress_ratios[:cfg.n_layers]:
        keys = win.clone()
        if r == 4:
            keys += torch.clamp((t + 1) // 4, max=cfg.index_topk)
            attn += (2 * cfg.index_n_heads * cfg.index_head_dim * ((t + 1) // 4)).mean().item()
        elif r:
            keys += (t + 1) // r
        attn += (4 * cfg.n_heads * cfg.head_dim * keys).mean().item()    # q.k and p.v
    return 2 * mats + attn


def timed(fn, iters=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def matmul_ceiling():
    a, b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16), torch.randn(8192, 8192, device="cuda",
                                                                                    dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / timed(lambda: a @ b, iters=10, warmup=3)


def breakdown(model, B, S):
    """fwd+bwd seconds of each sublayer kind on representative inputs (one layer each)."""
    cfg, dev = model.cfg, "cuda"
    x = torch.randn(B, S, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, cfg.vocab_size, (B, S), device=dev)
    h = torch.randn(B, S, cfg.hc_mult, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    kinds = {0: "attn_sliding", 4: "attn_c4", 128: "attn_c128"}
    for lid, r in enumerate(cfg.compress_ratios[:cfg.n_layers]):
        name = kinds.get(r, f"attn_c{r}")
        if name not in out:
            a = model.layers[str(lid)].attn
            out[name] = timed(lambda: a(x).float().sum().backward(), iters=3, warmup=1)
    blk = model.layers[str(cfg.n_layers - 1)]
    out["moe"] = timed(lambda: blk.ffn(x, ids).float().sum().backward(), iters=3, warmup=1)

    def mhc():
        y, post, comb = blk.hc_pre(h, blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base)
        hc_post(y, h, post, comb).float().sum().backward()
    out["mhc_pre_post"] = timed(mhc, iters=3, warmup=1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--recompute", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = preset(a.preset)
    with torch.device("cuda"):
        model = Transformer(cfg).init_weights(0).cast_(torch.bfloat16)
    model.recompute = bool(a.recompute)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        lp = model.token_logprobs(ids, torch.roll(ids, -1, 1))
        (-lp.mean()).backward()

    ceiling = matmul_ceiling()
    torch.cuda.reset_peak_memory_stats()
    sec = timed(step, iters=5, warmup=2)
    tokens = a.batch * a.seq
    flops = 3 * model_flops_per_token(cfg, a.seq) * tokens
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               preset=a.preset, batch=a.batch, seq=a.seq, recompute=bool(a.recompute),
               params=sum(p.numel() for p in model.parameters()), step_s=sec, tokens_per_s=tokens / sec,
               model_tflop_per_step=flops / 1e12, achieved_tflops=flops / sec / 1e12,
               matmul_ceiling_tflops=ceiling / 1e12, mfu=flops / sec / DATASHEET_BF16,
               ratio_to_ceiling=flops / sec / ceiling, peak_mem_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
               gflop_per_token_fwd=model_flops_per_token(cfg, a.seq) / 1e9)
    res["breakdown_s"] = breakdown(model, a.batch, a.seq)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Rollout benchmarks on H200s: FP8 quantization, NCCL weight push, embedded-server decode.

    python bench/bench_rollout.py --part quant            # one GPU
    python bench/bench_rollout.py --part push             # two GPUs: trainer cuda:0 -> embedded server cuda:1
    python bench/bench_rollout.py --part decode           # one GPU; transformers baseline if installed
    python bench/bench_rollout.py --part all --preset tiny --device cpu    # smoke test

quant:  `quant.quantize_fp8_block(w, fmt="fp32")` (Miles' convention) on bf16 weights; GB/s counts bytes read
        (bf16) + written (e4m3 + fp32 scales), against a measured device copy of the same tensor (read + write).
push:   the `small` model's FP8 stream (`iter_sglang_buckets`, 1 GiB buckets) from the trainer on cuda:0 into an
        embedded server on cuda:1 over NCCL (`update_weights_from_distributed`); GB/s of bytes moved, against a
        measured cuda:0 -> cuda:1 tensor copy; extrapolated to V4-Flash's FP8 stream size.
decode: the embedded engine (cache decode, bf16) generates 64 tokens for batch 1 and 32 (n samples of one
        prompt); tokens/s with and without the closing log-prob scoring pass, against transformers'
        `DeepseekV4ForCausalLM.generate` with the same geometry (random weights; speed does not depend on them).
Prints one JSON object per part; `--out FILE` also writes them.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanoflash.config import preset  # noqa: E402
from nanoflash.model import Transformer  # noqa: E402
from nanoflash.quant import quantize_fp8_block  # noqa: E402


def sync(dev):
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps=5):
    fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / reps


def bench_quant(dev, rows=16384, cols=16384):
    w = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    t_copy = timed(lambda: w.clone(), dev)
    t_q = timed(lambda: quantize_fp8_block(w, fmt="fp32"), dev)
    moved = w.numel() * (2 + 1) + (rows // 128) * (cols // 128) * 4
    return {"part": "quant", "shape": [rows, cols], "quant_s": t_q, "quant_GBps": moved / t_q / 1e9,
            "copy_GBps": 2 * w.numel() * 2 / t_copy / 1e9, "ratio_to_copy": (moved / t_q) / (4 * w.numel() / t_copy)}


def bench_push(preset_name, bucket_bytes):
    from nanoflash.rollout.client import SGLangClient
    from nanoflash.rollout.weight_sync import Broadcaster, iter_sglang_buckets, push_weights
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:0")
    t_p2p = timed(lambda: x.to("cuda:1"), "cuda:1")
    port = 31000 + os.getpid() % 1000
    srv = subprocess.Popen([sys.executable, "-m", "nanoflash.rollout.server", "--preset", preset_name, "--device",
                            "cuda:1", "--weights", "fp8", "--port", str(port), "--decode", "full"], cwd=ROOT)
    try:
        client = SGLangClient(f"http://127.0.0.1:{port}", retry_s=5.0)
        client.wait_healthy(timeout=600)
        with torch.device("cuda:0"):
            model = Transformer(preset(preset_name)).init_weights(0).cast_(torch.bfloat16)
        t0 = time.perf_counter()
        buckets = list(iter_sglang_buckets(model, fp8=True, bucket_bytes=bucket_bytes))
        torch.cuda.synchronize(0)
        t_stream = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        bc = Broadcaster(client, "127.0.0.1", port + 1, backend="nccl", group_name="bench", device="cuda:0")
        t0 = time.perf_counter()
        for b in buckets:
            bc.send(b, "1")
        t_send = time.perf_counter() - t0
        t0 = time.perf_counter()
        push_weights(client, buckets, version=2, transport="distributed", broadcaster=bc)
        t_full = time.perf_counter() - t0
    finally:
        srv.kill()
    flash_fp8_bytes = 284.3e9 * 1.0 + 2 * 129280 * 4096 * 2  # ~1 B/param FP8 + bf16 embed/head (rough)
    return {"part": "push", "preset": preset_name, "bytes": nbytes, "buckets": len(buckets),
            "stream_build_s": t_stream, "send_s": t_send, "send_GBps": nbytes / t_send / 1e9,
            "p2p_copy_GBps": x.numel() / t_p2p / 1e9, "ratio_to_copy": (nbytes / t_send) / (x.numel() / t_p2p),
            "full_protocol_with_verify_s": t_full,
            "flash_extrapolated_send_s": flash_fp8_bytes / (nbytes / t_send)}


def bench_decode(preset_name, dev, new_tokens=64):
    from nanoflash.rollout.engine import RolloutEngine, parse_sampling
    with torch.device(dev):
        model = Transformer(preset(preset_name)).init_weights(0).cast_(torch.bfloat16)
    eng = RolloutEngine(model, weights="bf16", decode="cache")
    prompt = list(range(1, 17))
    out = {"part": "decode", "preset": preset_name, "cache_decode": eng.use_cache}
    for n in (1, 32):
        sp = parse_sampling({"n": n, "max_new_tokens": new_tokens, "temperature": 1.0}, model.cfg.vocab_size)
        eng.generate(prompt, dict(sp, max_new_tokens=2))
        sync(dev)
        t = time.perf_counter()
        eng.score = lambda full, p, T: [0.0] * (len(full) - p)  # decode only
        eng.generate(prompt, sp)
        sync(dev)
        t_dec = time.perf_counter() - t
        del eng.score
        t = time.perf_counter()
        eng.generate(prompt, sp)
        sync(dev)
        t_all = time.perf_counter() - t
        out[f"b{n}_decode_tok_s"] = n * new_tokens / t_dec
        out[f"b{n}_with_scoring_tok_s"] = n * new_tokens / t_all
        out[f"b{n}_hf_tok_s"] = hf_generate_tok_s(model.cfg, dev, n, prompt, new_tokens)
    return out


def hf_generate_tok_s(cfg, dev, n, prompt, new_tokens):
    try:
        import transformers
    except ImportError:
        return None
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    L = cfg.n_layers
    hc = transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim, num_hidden_layers=L,
        num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts, layer_types=[kinds.get(r, "heavily_compressed_attention")
                                                            for r in cfg.compress_ratios[:L]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        hc_mult=cfg.hc_mult, sliding_window=cfg.window_size, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        mlp_layer_types=["hash_moe"] * cfg.n_hash_layers + ["moe"] * (L - cfg.n_hash_layers),
        num_nextn_predict_layers=0)
    with torch.device(dev):
        hf = transformers.DeepseekV4ForCausalLM(hc).to(torch.bfloat16).eval()
    ids = torch.tensor([prompt] * n, device=dev)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **dict(kw, max_new_tokens=2, min_new_tokens=2))
        sync(dev)
        t = time.perf_counter()
        hf.generate(ids, **kw)
        sync(dev)
    return n * new_tokens / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["quant", "push", "decode", "all"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    if args.part in ("quant", "all"):
        size = 16384 if args.device.startswith("cuda") else 1024
        results.append(bench_quant(args.device, size, size))
        print(json.dumps(results[-1]), flush=True)
    if args.part in ("push", "all") and torch.cuda.device_count() >= 2:
        results.append(bench_push(args.preset, args.bucket_bytes))
        print(json.dumps(results[-1]), flush=True)
    if args.part in ("decode", "all"):
        results.append(bench_decode(args.preset, args.device))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

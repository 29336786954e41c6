"""Memory planner: a dry run of a PP x EP x DP layout on the meta device, per rank and per host.

    python -m nanoflash.parallel.planner --preset flash --pp 4 --ep 4 --recompute --offload

Per rank (pp_rank, ep_rank) it counts, from the parameter names of a model built on `meta` and the same
ownership rules as `build_stage` / `apply_expert_parallel` (layers by stage, experts by EP shard):

    params      numel x element size after `model.cast_(bf16)` (fp32 where the official model keeps fp32)
    grads       same bytes as the trainable params (frozen router / indexer / MTP get none)
    optimizer   fp32 master + Adam m, v = 12 bytes per trainable param (8 if the param is fp32) - on the
                host with --offload
    activations per in-flight micro-batch of T = micro_batch_tokens tokens (one sequence, the worst case);
                1F1B keeps min(pp - pp_rank, m) micro-batches alive on stage pp_rank.
                recompute: the stored layer inputs h [T,M,D] per layer, plus one layer's full activations
                (the layer being recomputed); no recompute: every layer's full activations.

A layer's full activations are *measured*, not guessed: `measure_layer_bytes` runs one Block of the config
(with only n_activated + 2 routed experts, which does not change the per-token activations beyond the gate
scores) under `saved_tensors_hooks` at two lengths and fits bytes(S) = a S + b pairs(S), where pairs(S)
counts the (query, key) pairs of nanoflash's dense masked attention (window slice per query chunk plus all
S / ratio compressed keys): that term dominates at 8K tokens and is where nanoflash pays for not having the
official sparse-gather kernel. `MEASURED_FLASH` holds the fit for `flash`
(bf16, CPU, see `--measure`), so the default run needs no compute.

Not counted: the CUDA context and allocator fragmentation (add ~2-5 GB per GPU), NCCL buffers, the
rollout engine's memory. Tests: `pytest tests/test_parallel_planner.py -q`.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from nanoflash.checkpoint_names import official_parameters
from nanoflash.config import ParallelConfig, preset
from nanoflash.model import Block, Transformer
from nanoflash.parallel.expert import EXPERT_KEY, expert_range
from nanoflash.parallel.optim import is_frozen
from nanoflash.parallel.pipeline import LAST_STAGE_MODULES, LAST_STAGE_PARAMS, split_layers

GIB = 2 ** 30
# bytes(S) = a*S + b*pairs(S) of one layer's saved activations, bf16 weights, per compress ratio (0 / 4 / 128):
# `measure_layer_bytes(preset("flash"), (4096, 8192), device="cuda")` on one H200, 2026-11-29
# (bench/parallel_memory.py). A CPU fit at (512, 1024) agreed within 8%. The same method on the `small`
# preset predicted its measured T=4096 activations (no recompute) within 1% (51.1 vs 50.7 GiB).
MEASURED_FLASH: dict[int, tuple[float, float]] = {0: (1350174, 491.5), 4: (1387244, 511.81), 128: (1405243, 465.76)}


def owner(name: str, cfg, pp: int, ep: int, layer_split=None) -> tuple[int | None, int | None]:
    """(pipeline stage, EP rank) holding parameter `name`; None means "every one" on that axis."""
    parts = name.split(".")
    ep_rank = None
    if EXPERT_KEY in name:
        e = int(name.split(EXPERT_KEY)[1].split(".")[0])
        ep_rank = next(r for r in range(ep) if e in expert_range(cfg.n_routed_experts, ep, r))
    if parts[0] == "layers":
        stage = next(s for s, ids in enumerate(split_layers(cfg.n_layers, pp, layer_split)) if int(parts[1]) in ids)
    elif parts[0] == "embed":
        stage = 0
    elif parts[0] in LAST_STAGE_MODULES or parts[0] in LAST_STAGE_PARAMS:
        stage = pp - 1
    else:
        raise ValueError(f"planner: no pipeline-stage rule for parameter {name!r}")
    return stage, ep_rank


def attention_pairs(cfg, ratio: int, S: int) -> int:
    """(query, key) pairs of nanoflash's dense masked attention on one S-token sequence: each query chunk
    sees its window slice [a-W+1, b) and all S // ratio compressed entries (masked, but materialised)."""
    pairs = 0
    for a in range(0, S, cfg.attn_chunk):
        b = min(a + cfg.attn_chunk, S)
        pairs += (b - a) * ((b - max(a - cfg.window_size + 1, 0)) + (S // ratio if ratio else 0))
    return pairs


def layer_act_bytes(cfg, ratio: int, tokens: int, fit: dict) -> float:
    a, b = fit[ratio]
    return a * tokens + b * attention_pairs(cfg, ratio, tokens)


def plan(cfg, par: ParallelConfig, fit: dict, dtype=torch.bfloat16, train_mtp: bool = False,
         model=None) -> list[dict]:
    """One row per (pp_rank, ep_rank): bytes of params, grads, optimizer state and activations.
    `model`: an already built full meta model of `cfg` to reuse (it is cast to `dtype`)."""
    if model is None:
        with torch.device("meta"):
            model = Transformer(cfg)
    model.cast_(dtype)
    dp = par.dp or 1
    rows = {(s, e): dict(pp_rank=s, ep_rank=e, params=0, param_bytes=0, grad_bytes=0, optim_bytes=0)
            for s in range(par.pp) for e in range(par.ep)}
    for name, p in official_parameters(model):  # stacked experts by their official per-expert names
        stage, ep_rank = owner(name, cfg, par.pp, par.ep, par.layer_split)
        for e in ([ep_rank] if ep_rank is not None else range(par.ep)):
            r = rows[(stage, e)]
            r["params"] += p.numel()
            r["param_bytes"] += p.numel() * p.element_size()
            if not is_frozen(name, train_mtp):
                r["grad_bytes"] += p.numel() * p.element_size()
                r["optim_bytes"] += p.numel() * (8 if p.dtype == torch.float32 else 12)
    layers = split_layers(cfg.n_layers, par.pp, par.layer_split)
    T, M, D = par.micro_batch_tokens, cfg.hc_mult, cfg.dim
    for (s, _), r in rows.items():
        in_flight = par.pp - s  # 1F1B, assuming at least pp micro-batches per step
        per_layer = [layer_act_bytes(cfg, cfg.compress_ratios[i], T, fit) for i in layers[s]]
        if par.recompute:
            stored = len(per_layer) * T * M * D * torch.finfo(dtype).bits // 8
            r["act_bytes"] = in_flight * stored + max(per_layer)
        else:
            r["act_bytes"] = in_flight * sum(per_layer)
        r["gpu_bytes"] = r["param_bytes"] + r["grad_bytes"] + r["act_bytes"] + (0 if par.offload_optimizer
                                                                                   else r["optim_bytes"])
        r["host_bytes"] = r["optim_bytes"] if par.offload_optimizer else 0
        r["dp"] = dp
    return list(rows.values())


def measure_layer_bytes(cfg, seq_lens=(128, 256), dtype=torch.bfloat16, device="cpu") -> dict[int, tuple]:
    """Fit bytes(S) = a S + b pairs(S) of the tensors autograd saves in one Block, per compress ratio."""
    small = dataclasses.replace(cfg, n_routed_experts=cfg.n_activated_experts + 2, n_hash_layers=0)
    fit = {}
    for ratio in sorted(set(cfg.compress_ratios)):
        layer_id = cfg.compress_ratios.index(ratio)
        with torch.device(device):
            block = Block(layer_id, small)
        with torch.no_grad():  # the Transformer.init_weights rules, so routing and top-k see sane values
            for name, p in block.named_parameters():
                if name.endswith(("norm.weight", "_scale")):
                    p.fill_(1.0)
                elif name.endswith(("_base", "attn_sink", "ape", "gate.bias")):
                    p.zero_()
                else:
                    p.normal_(0, 0.02)
        block.to(dtype)
        weights = {p.untyped_storage().data_ptr() for p in block.parameters()}  # saved too, but not activations
        measured = []
        for S in seq_lens:
            h = torch.randn(1, S, cfg.hc_mult, cfg.dim, dtype=dtype, device=device, requires_grad=True)  # [B,S,M,D]
            seen = {}

            def pack(t):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in weights:
                    seen[ptr] = t.untyped_storage().nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                block(h, torch.zeros(1, S, dtype=torch.long, device=device))
            measured.append(sum(seen.values()))
        (s1, s2), (m1, m2) = seq_lens, measured  # solve m = a S + b pairs(S) at both lengths
        p1, p2 = attention_pairs(cfg, ratio, s1), attention_pairs(cfg, ratio, s2)
        b = (m2 * s1 - m1 * s2) / (p2 * s1 - p1 * s2)
        fit[ratio] = ((m1 - b * p1) / s1, b)
    return fit


def _report(rows, cfg_name: str, par: ParallelConfig, gpus_per_host: int) -> str:
    head = f"{cfg_name}: PP{par.pp} x EP{par.ep} x DP{par.dp or 1}, {par.micro_batch_tokens} tokens/micro-batch, " \
           f"recompute={par.recompute}, offload={par.offload_optimizer}"
    cols = f"{'pp':>3} {'ep':>3} {'params':>9} {'weights':>9} {'grads':>8} {'optim':>8} {'acts':>8} {'GPU':>8} {'host':>8}"
    lines = [head, cols + "   (GiB; params in billions)"]
    for r in rows:
        lines.append(f"{r['pp_rank']:>3} {r['ep_rank']:>3} {r['params'] / 1e9:>9.2f} {r['param_bytes'] / GIB:>9.1f} "
                     f"{r['grad_bytes'] / GIB:>8.1f} {r['optim_bytes'] / GIB:>8.1f} {r['act_bytes'] / GIB:>8.1f} "
                     f"{r['gpu_bytes'] / GIB:>8.1f} {r['host_bytes'] / GIB:>8.1f}")
    worst_gpu = max(r["gpu_bytes"] for r in rows) / GIB
    per_host = sorted(r["host_bytes"] for r in rows)[-gpus_per_host:]
    lines.append(f"max per GPU: {worst_gpu:.1f} GiB (+ CUDA context / fragmentation); host, worst {gpus_per_host} "
                 f"ranks on one node: {sum(per_host) / GIB:.1f} GiB of optimizer state")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--gpus-per-host", type=int, default=4)
    ap.add_argument("--measure", action="store_true", help="measure the activation fit instead of MEASURED_FLASH")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)
    par = ParallelConfig(pp=a.pp, ep=a.ep, dp=a.dp, micro_batch_tokens=a.micro_batch_tokens,
                         recompute=a.recompute, offload_optimizer=a.offload)
    fit = MEASURED_FLASH if (a.preset == "flash" and MEASURED_FLASH and not a.measure) else measure_layer_bytes(cfg)
    if a.measure:
        print("activation fit bytes(S) = a*S + b*pairs(S) per ratio:", {k: (round(x), round(y, 2)) for k, (x, y) in fit.items()})
    text = _report(plan(cfg, par, fit), a.preset, par, a.gpus_per_host)
    print(text)
    return text


if __name__ == "__main__":
    main()

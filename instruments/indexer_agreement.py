"""Which C4 entries the lightning indexer keeps: nanoflash's bf16 scores against SGLang's FP8 scores.

At a query position t >= 4 x index_topk (2048 in V4) a C4 layer keeps the top-512 of its (t + 1) // 4 visible
compressed entries by the indexer's score. nanoflash scores in the trainer's precision; SGLang 0.5.16 on Hopper
scores in FP8 (DeepGEMM `fp8_paged_mqa_logits` on Hadamard-rotated FP8 rows, reproduced by
`quant.fp8_index_sim`). Near-ties at the cut can then keep different entries, and a response token whose logits
read a different set of the context differs for that reason alone. This measures it on given positions:

    agreement(model, ids, positions)            # {layer: overlap of the kept sets, bf16 vs FP8 scores}
    agreement_with_server(model, ids, server)   # nanoflash's kept sets vs the ones SGLang reports

For each C4 layer the indexer's inputs (x, qr) are captured from one forward of the model on `ids`
(`capture_indexer_inputs`), the query, keys and head weights rebuilt from them by the indexer's own methods,
and both kept sets formed by the model's rule (`model.index_scores`, stable descending sort: ties to the lower
entry). overlap(t) = |A_t & B_t| / |A_t|; per layer: its mean and minimum, the share of positions whose sets
are identical, the mean number of entries swapped.

SGLang reports its own sets when started with `--enable-return-indexer-topk` (0.5.16: `srt/server_args.py`
2851, `srt/state_capturer/indexer_topk.py`) and asked with `"return_indexer_topk": true`: `meta_info
["indexer_topk"]`, base64 int32 of shape [sequence length - 1, C4 layers, index_topk], row t the entries the
query at position t kept (raw entry indices, -1 padded), `sglang.client.decode_indexer_topk`.

Tests: `pytest experiments/h200/test_long.py -q`.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

import nanoflash.model as M


@contextlib.contextmanager
def capture_indexer_inputs(model):
    """While active, every prefill call (start_pos 0, no cached keys) of a C4 indexer records its (x, qr):
    yields {module name: (x [B,S,D], qr [B,S,q_lora])}, the last call's per indexer."""
    out, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, M.Indexer):
            def pre(m, args, name=name):
                x, qr, start_pos, keys_before = args[:4]
                if start_pos == 0 and keys_before is None:
                    out[name] = (x.detach(), qr.detach())
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def kept_sets(indexer, x, qr, positions: torch.Tensor, quant: str) -> torch.Tensor:
    """The entries the indexer keeps at query `positions` of one sequence, its operands in precision `quant`
    (`ModelConfig.indexer_quant`: "none" = the raw operands, "fp8" = SGLang's). x [1,S,D], qr [1,S,q_lora],
    positions [n] -> [n, index_topk] int64, best first, -1 where fewer entries are visible."""
    cfg = dataclasses.replace(indexer.cfg, indexer_quant=quant)
    q = M.index_sim(cfg, _raw_query(indexer, qr))[0, positions]                    # [n,HI,dI]
    keys = M.index_sim(cfg, _raw_keys(indexer, x))[0]                               # [C,dI]
    w = indexer.head_weights(x)[0, positions]                                       # [n,HI]
    score = torch.einsum("nhd,cd->nhc", q.float(), keys.float()).relu()
    score = (score * w[..., None]).sum(1)                                           # [n,C]
    visible = torch.arange(keys.shape[0], device=x.device)[None] < (positions[:, None] + 1) // 4
    score = score.masked_fill(~visible, float("-inf"))
    k = cfg.index_topk
    top = score.sort(dim=-1, descending=True, stable=True).indices[:, :k]           # [n,<=k]
    top = torch.where(score.gather(-1, top) > float("-inf"), top, -1)
    return torch.nn.functional.pad(top, (0, k - top.shape[1]), value=-1)


def _raw_query(indexer, qr):
    """qI before the precision simulation (what `Indexer.query` passes to `index_sim`). -> [1,S,HI,dI]"""
    cfg = indexer.cfg
    pos = torch.arange(qr.shape[1], device=qr.device)
    q = indexer.wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
    return M.apply_rope(q, *M.rope_angles(cfg, True, pos))


def _raw_keys(indexer, x):
    """The indexer's keys before the precision simulation. -> [1,C,dI]"""
    comp = indexer.compressor
    saved = comp.cfg
    comp.cfg = dataclasses.replace(saved, indexer_quant="none")   # finish() applies index_sim(comp.cfg)
    try:
        return comp(x, 0)[0]
    finally:
        comp.cfg = saved


def overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|A & B| / |A| per row of two kept-set lists (-1 = none), on a's device (b is moved there: the server's
    sets arrive on the CPU, the trainer's on its GPU). [n,k] x [n,k'] -> [n] fp64 (1.0 where A is empty)"""
    b = b.to(a.device)
    sb = torch.where(b >= 0, b, -2).sort(-1).values       # -2: b's padding never matches a's (-1 or an entry)
    i = torch.searchsorted(sb, a.contiguous()).clamp_max(sb.shape[-1] - 1)
    hit = (sb.gather(-1, i) == a) & (a >= 0)                # kept sets hold each entry at most once
    n_a = (a >= 0).sum(-1)
    return torch.where(n_a > 0, hit.sum(-1).double() / n_a.clamp_min(1), 1.0)


def overlap_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Per-position overlaps of two kept-set lists summarised: mean, min, identical share, swapped entries."""
    ov = overlap(a, b)
    n_kept = (a >= 0).sum(-1).double()
    return {"positions": len(ov), "overlap_mean": float(ov.mean()), "overlap_min": float(ov.min()),
            "identical_share": float((ov == 1.0).double().mean()), "swapped_mean": float(((1 - ov) * n_kept).mean())}


def _check_raw(model):
    mode = model.cfg.indexer_quant if model.cfg.indexer_quant != "qat" else ("fp4" if model.cfg.qat else "none")
    if mode != "none":
        raise ValueError(f"indexer agreement compares nanoflash's exact (bf16) indexer with SGLang's FP8 one; this "
                         f"model's indexer already runs {mode!r} (indexer_quant={model.cfg.indexer_quant!r}, "
                         f"qat={model.cfg.qat})")


@torch.no_grad()
def agreement_sets(model, ids: torch.Tensor, positions: torch.Tensor, quant: str = "fp8") -> dict:
    """Per C4 layer, the entries the model keeps (exact scores) and those `quant` scores keep, at query
    `positions` of the one sequence `ids` [1,S]. -> {layer name: ([n,k], [n,k])}"""
    _check_raw(model)
    with capture_indexer_inputs(model) as cap:
        model.run_layers(model.embed_streams(ids), ids)
    return {name: (kept_sets(model.get_submodule(name), x, qr, positions, "none"),
                   kept_sets(model.get_submodule(name), x, qr, positions, quant)) for name, (x, qr) in cap.items()}


def agreement(model, ids: torch.Tensor, positions: torch.Tensor, quant: str = "fp8") -> dict:
    """`agreement_sets` summarised: {layer name: overlap_stats}"""
    return {name: overlap_stats(a, b) for name, (a, b) in agreement_sets(model, ids, positions, quant).items()}


@torch.no_grad()
def agreement_with_server(model, ids: torch.Tensor, server_topk: torch.Tensor, positions: torch.Tensor) -> dict:
    """Per C4 layer (in layer order, as SGLang numbers its C4 layers), the overlap of the entries nanoflash keeps
    at query `positions` with the ones the server reported (`sglang.client.decode_indexer_topk`, row t = query t)."""
    with capture_indexer_inputs(model) as cap:
        model.run_layers(model.embed_streams(ids), ids)
    names = sorted(cap, key=lambda n: int(n.split(".")[1]))      # layers.<L>.attn.indexer
    if server_topk.shape[1] != len(names):
        raise ValueError(f"the server reported {server_topk.shape[1]} C4 layers; this model has {len(names)}")
    out = {}
    for i, name in enumerate(names):
        x, qr = cap[name]
        ours = kept_sets(model.get_submodule(name), x, qr, positions, model.cfg.indexer_quant)
        out[name] = overlap_stats(ours, server_topk[positions, i])
    return out

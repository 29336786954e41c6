"""Per-block activations of a model, the `/nanoflash/trace` route's answer (`instruments.mismatch` compares
two engines' traces site by site to name the first block that diverges).

Sites in forward order: "embed" (streams [1,S,M,D]); per layer L and half H in (attn, ffn):
    layers.L.H.in   the sublayer input after mHC pre-collapse (hc_pre)          [1,S,D]
    layers.L.H.out  the sublayer output (attention, or routing + experts)       [1,S,D]
    layers.L.H.mix  the M streams after mHC post-mixing with comb (hc_post)     [1,S,M,D]
then "logits" [1,S,V]. `trace` walks each `Block` exactly as `Block.forward` does, through the block's own
methods; a test asserts it reproduces `model(ids)` bit for bit.

Tests: `pytest tests/test_rollout_mismatch.py -q`.
"""
from __future__ import annotations

import torch

from nanoflash.model import hc_post


@torch.no_grad()
def trace(model, ids: torch.Tensor) -> dict:
    """Activations at every block boundary. ids [1,S] -> {site: tensor} (streams [1,S,M,D], logits [1,S,V])"""
    out = {}
    h = model.embed_streams(ids)                                                    # [1,S,M,D]
    out["embed"] = h
    for key in sorted(model.layers, key=int):
        blk = model.layers[key]
        for half, norm, sub in (("attn", blk.attn_norm, lambda x: blk.attn(x, 0, None)),
                                ("ffn", blk.ffn_norm, lambda x: blk.ffn(x, ids))):
            fn, scale, base = (getattr(blk, f"hc_{half}_{p}") for p in ("fn", "scale", "base"))
            x, post, comb = blk.hc_pre(h, fn, scale, base)                          # x [1,S,D]
            y = sub(norm(x))                                                        # [1,S,D]
            h = hc_post(y, h, post, comb)                                 # [1,S,M,D]
            out[f"layers.{key}.{half}.in"], out[f"layers.{key}.{half}.out"] = x, y
            out[f"layers.{key}.{half}.mix"] = h
    out["logits"] = model.logits(h)
    return out

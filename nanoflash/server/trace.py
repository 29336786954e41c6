"""Per-block activations of a model, the `/nanoflash/trace` route's answer (`instruments.mismatch` compares
two engines' traces site by site to name the first block that diverges).

Sites in forward order: "embed" (streams [1,S,M,D]); per layer L and half H in (attn, ffn):
    layers.L.H.in   the sublayer input after mHC pre-collapse (hc_pre)          [1,S,D]
    layers.L.H.out  the sublayer output (attention, or routing + experts)       [1,S,D]
    layers.L.H.mix  the M streams after mHC post-mixing with comb (hc_post)     [1,S,M,D]
then "logits" [1,S,V]. `trace` walks each `Block` exactly as `Block.forward` does, through the block's own
methods; a test asserts it reproduces `model(ids)` bit for bit.

Bounded (`checked_ids`): the answer grows as S x (M D (1 + 2 L) + 4 L D + V) floats, base64 on the wire
(tiny: ~3 KB a token; the `small` preset ~1.8 MB; flash ~10 MB), so the route takes at most the model's
max_seq_len ids and refuses (413) a request whose answer would pass the server's `max_trace_bytes`
(`answer_bytes` is an upper bound, computed before any forward). Without an API key the server answers the
route to loopback clients only (`http_guard.LOCAL_ROUTES`): activations describe the served weights.

Tests: `pytest tests/test_rollout_mismatch.py tests/test_trace_route.py -q`.
"""
from __future__ import annotations

import torch

from nanoflash.model import hc_post
from nanoflash.server.engine import BadRequest, check_ids
from nanoflash.server.http_guard import HTTPError

MAX_TRACE_BYTES = 256 << 20   # default bound of one answer: ~140 tokens of the `small` preset, 100K of tiny
SITE_HEADER_BYTES = 256       # safetensors header entry of one site (name, dtype, shape, offsets), generous


def answer_bytes(model, n_ids: int) -> int:
    """Upper bound of the route's answer for n_ids tokens: every site's floats at 4 bytes, headers, base64."""
    c, n_layers = model.cfg, len(model.layers)
    floats = c.hc_mult * c.dim * (1 + 2 * n_layers) + 4 * n_layers * c.dim + c.vocab_size   # per token
    raw = n_ids * floats * 4 + SITE_HEADER_BYTES * (2 + 6 * n_layers)
    return 4 * (raw + 2) // 3 + 64   # base64, and the JSON around it


def checked_ids(body: dict, model, max_bytes: int) -> list:
    """The request's input_ids, within the model's max_seq_len and an answer of at most max_bytes; else
    BadRequest (400) / HTTPError 413 naming the bound."""
    ids = check_ids("/nanoflash/trace", body.get("input_ids"), model.cfg.vocab_size)
    if len(ids) > model.cfg.max_seq_len:
        raise BadRequest(f"/nanoflash/trace: {len(ids)} input_ids > the model's max_seq_len="
                         f"{model.cfg.max_seq_len}")
    need = answer_bytes(model, len(ids))
    if need > max_bytes:
        fit = next((n for n in range(len(ids), 0, -1) if answer_bytes(model, n) <= max_bytes), 0)
        raise HTTPError(413, f"/nanoflash/trace: the answer for {len(ids)} ids would take up to {need} bytes, "
                             f"over this server's max_trace_bytes={max_bytes}; trace at most {fit} ids (or start "
                             f"the server with a larger --max-trace-bytes)")
    return ids


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

"""Train/rollout mismatch finder: generate once, score the same tokens with both engines, then localize.

The method (the one that found the reference deployment's mismatches), as a command:

    python -m instruments.mismatch --url http://127.0.0.1:30000 --preset tiny --seed 0

1. The rollout server samples completions of a few prompts and returns per-token log-probs r_t.
2. The trainer model scores the very same tokens: t_t = log_softmax(logits / T)[token_t].
3. Report |t_t - r_t| over all sampled tokens: mean, p99, max (Miles' `train_rollout_logprob_abs_diff` is
   the per-sample mean of this).
4. When the server is nanoflash's own (it answers `POST /nanoflash/trace`), both sides run `trace` on the
   same token ids and the report names the first site, in forward order, whose max |difference| exceeds
   `tol`. Sites per layer L and half H in (attn, ffn):
       layers.L.H.in   the sublayer input after mHC pre-collapse (hc_pre)          [1,S,D]
       layers.L.H.out  the sublayer output (attention, or routing + experts)       [1,S,D]
       layers.L.H.mix  the M streams after mHC post-mixing with comb (hc_post)     [1,S,M,D]
   plus "embed" (streams [1,S,M,D]) first and "logits" last. So ".out" blames the sublayer itself
   (e.g. hash routing), ".mix" the residual mixing (e.g. comb applied transposed; note that while all M
   streams are still equal -- layer 0's attention half -- a transposed doubly-stochastic comb changes
   nothing, so that bug first shows at layers.0.ffn.mix).

`trace` (nanoflash/server/trace.py, what the server answers) walks a `Block` exactly as `Block.forward` does (hc_pre -> sublayer -> hc_post, twice) through the
block's own methods; a test asserts it reproduces `model(ids)` bit for bit.

Tests: `pytest tests/test_rollout_mismatch.py -q`.
"""
from __future__ import annotations

import argparse
import json

import torch

from nanoflash.server.trace import trace  # noqa: F401  (the sites both engines record)

TRACE_TOL = 1e-5  # fp32 engines on the same device agree to ~1e-7; a planted bug moves activations by >1e-3


def first_divergence(a: dict, b: dict, tol: float = TRACE_TOL):
    """(site, max |a - b|) of the first site in trace order whose difference exceeds tol, else (None, max)."""
    worst = 0.0
    for site in a:
        if site not in b or a[site].shape != b[site].shape:
            return site, float("inf")
        d = float((a[site].float() - b[site].float()).abs().max())
        worst = max(worst, d)
        if d > tol:
            return site, d
    return None, worst


def logprob_mismatch(client, model, prompts: list, max_new_tokens: int = 16, temperature: float = 1.0) -> dict:
    """Steps 1-3: per-token |trainer - rollout| log-prob statistics over freshly sampled completions."""
    diffs, gens = [], []
    for p in prompts:
        g = client.generate(p, {"temperature": temperature, "max_new_tokens": max_new_tokens})[0]
        if not g.output_ids:
            continue
        full = torch.tensor(list(p) + g.output_ids)
        with torch.no_grad():
            t = model.token_logprobs(full[None, :-1], full[None, 1:], temperature=temperature or 1.0)
        diffs.append((t[0, len(p) - 1:] - torch.tensor(g.logprobs)).abs())
        gens.append(full)
    if not diffs:
        raise RuntimeError("the server returned no tokens for any prompt; nothing to compare")
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "p99": float(d.quantile(0.99)),
            "max": float(d.max()), "sequences": gens}


def localize(client, model, ids: torch.Tensor, tol: float = TRACE_TOL, url: str | None = None) -> dict:
    """Step 4: ask a nanoflash server for its trace of `ids` and find where it leaves the trainer's."""
    from nanoflash.sglang.transports import decode_tensors
    url = url or client.urls[0]
    remote = dict(decode_tensors(client.post(url, "/nanoflash/trace", {"input_ids": ids.tolist()})["trace"]))
    site, d = first_divergence(trace(model, ids[None]), {k: v for k, v in remote.items()}, tol)
    return {"first_divergence": site, "max_abs_diff": d}


def report(client, model, prompts: list, max_new_tokens: int = 16, temperature: float = 1.0,
           tol: float = TRACE_TOL) -> dict:
    """The whole method: log-prob statistics, then (nanoflash server) the first diverging site."""
    stats = logprob_mismatch(client, model, prompts, max_new_tokens, temperature)
    seqs = stats.pop("sequences")
    try:
        stats.update(localize(client, model, seqs[0], tol))
    except Exception as e:  # a real SGLang server has no trace route: the statistics stand alone
        stats["first_divergence"] = f"unavailable ({type(e).__name__}: {str(e)[:120]})"
    return stats


def main(argv=None):
    from nanoflash.config import preset
    from nanoflash.model import Transformer
    from nanoflash.sglang.client import SGLangClient
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="rollout server (SGLang or nanoflash)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0, help="trainer weights: Transformer(preset).init_weights(seed)")
    ap.add_argument("--prompts", type=int, default=4, help="number of random prompts of 8 tokens")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=TRACE_TOL)
    args = ap.parse_args(argv)
    model = Transformer(preset(args.preset)).init_weights(args.seed).eval()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.cfg.vocab_size, (args.prompts, 8), generator=g).tolist()
    out = report(SGLangClient(args.url), model, prompts, args.max_new_tokens, args.temperature, args.tol)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

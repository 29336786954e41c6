"""Behavioural check of a weight push: does the server now predict what the trainer predicts?

Checksums (`transports.verify_real_server`) say the bytes landed; they cannot say the server *computes* with
them as the trainer does (a tensor read in the wrong layout hashes fine). The probe asks for that:

    server:  y = sample(prompt; T, fixed sampling seed, PROBE_TOKENS tokens, EOS ignored), r_t = its log-probs
    trainer: t_t = log_softmax(f_theta(prompt + y) / T)[y_t]     on the very same tokens
    gap = mean_t |t_t - r_t|            must stay below PROBE_MAX_MEAN (else the run stops: `require_landed`)

With `other` (e.g. the warm start) the same tokens are scored by it too: `other_mean` = |other - server| and
`shift_mean` = |trainer - other|. Once training has moved the weights (shift well above the gap), a server
still holding the old weights shows other_mean < mean: the probe then tells which weights the server runs.
Sampling at T = 1 (not greedy) keeps unlikely tokens in the probe, where log-probs move most with the weights.
`prefill_logprobs` asks the server for its log-probs of given tokens in one prefill (SGLang's
`logprob_start_len`): against the rollout's decode log-probs it separates the server's decode path from its
forward (`rl/live.py`).

Tests: `pytest experiments/h200/test_h200_pieces.py tests/test_rollout_server.py -q`.
"""
from __future__ import annotations

import torch

PROBE_TOKENS = 32
# A landed push leaves the FP8 gap (0.06-0.10 mean |dlogp| measured against SGLang 0.5.16, docs/sglang.md);
# a missed or mis-laid tensor gives O(1) gaps. 0.5 sits 5x above the measured gap and far below a failure.
PROBE_MAX_MEAN = 0.5


@torch.no_grad()
def score(model, prompt: list, ids: list, temperature: float) -> torch.Tensor:
    """The model's log-probs of `ids` after `prompt`. -> [len(ids)] fp32 on the CPU."""
    dev = next(model.parameters()).device
    full = torch.tensor(list(prompt) + list(ids), device=dev)                    # [P+R]
    scored = torch.arange(len(full) - 1, device=dev) >= len(prompt) - 1           # the head at ids' positions only
    lp = model.token_logprobs(full[None, :-1], full[None, 1:], temperature=temperature, mask=scored[None])
    return lp[0, len(prompt) - 1:].float().cpu()


def probe(client, model, prompt: list, seed: int, temperature: float = 1.0, n_tokens: int = PROBE_TOKENS,
          other=None, url: str | None = None) -> dict:
    """Sample on the server, score on the trainer (and on `other`). -> {mean, max, other_mean, shift_mean,
    tokens, version}."""
    sp = {"n": 1, "temperature": temperature, "max_new_tokens": n_tokens, "sampling_seed": seed, "ignore_eos": True}
    g = client.generate(list(prompt), sp, url=url)[0]
    if not g.output_ids or len(g.logprobs) != len(g.output_ids):
        raise ValueError(f"probe: {g.server} returned {len(g.output_ids)} tokens and {len(g.logprobs)} log-probs")
    server = torch.tensor(g.logprobs, dtype=torch.float32)
    ours = score(model, prompt, g.output_ids, temperature)
    out = {"mean": float((ours - server).abs().mean()), "max": float((ours - server).abs().max()),
           "tokens": len(g.output_ids), "version": g.weight_version}
    if other is not None:
        theirs = score(other, prompt, g.output_ids, temperature)
        out.update(other_mean=float((theirs - server).abs().mean()), shift_mean=float((ours - theirs).abs().mean()))
    return out


def require_landed(p: dict, version) -> None:
    """Stop with one line naming what failed: the reported weight version, or a probe gap over the bound."""
    if p.get("version") is not None and str(p["version"]) != str(version):
        raise SystemExit(f"probe after push v{version}: the server reports weight version {p['version']}")
    if not p["mean"] < PROBE_MAX_MEAN:
        raise SystemExit(f"probe after push v{version}: mean |dlogp| {p['mean']:.3f} on the fixed prompt is above "
                         f"{PROBE_MAX_MEAN} (max {p['max']:.3f}): the server does not compute with what was pushed")


def prefill_logprobs(client, sequences: list, temperature: float = 1.0, url: str | None = None,
                     flags: dict | None = None, metas: list | None = None) -> list:
    """The server's log-probs of given tokens, scored in one prefill (no sampling, no prefix cache: SGLang
    reuses a cached prefix only up to `logprob_start_len`, here 0): one list per sequence, value i is
    log p(x_{i+1} | x_<=i), so len(x) - 1 values. One batched /generate (max_new_tokens 1, its token unused).
    `flags`: more request fields (e.g. {"return_indexer_topk": True}); `metas`: a list that receives each
    sequence's meta_info, in order (what those fields asked for)."""
    url = url or client.urls[0]
    body = {"input_ids": [list(x) for x in sequences], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature}, **(flags or {})}
    out = client.post(url, "/generate", body)
    items = out if isinstance(out, list) else [out]
    if len(items) != len(sequences):
        raise ValueError(f"{url}: prefill scoring of {len(sequences)} sequences returned {len(items)} results")
    res = []
    for x, it in zip(sequences, items):
        lps = (it.get("meta_info") or {}).get("input_token_logprobs") or []
        if [t[1] for t in lps] != list(x) or any(t[0] is None for t in lps[1:]):
            raise ValueError(f"{url}: input_token_logprobs do not match the {len(x)} tokens sent "
                             f"(got {len(lps)}: {str(lps)[:120]})")
        res.append([float(t[0]) for t in lps[1:]])
        if metas is not None:
            metas.append(it.get("meta_info") or {})
    return res

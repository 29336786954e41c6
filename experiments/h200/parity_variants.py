"""Variants of nanoflash's forward for `experiments/h200/sglang_check.py parity --variants ...`: "nanoflash with semantics X",
scored on the same tokens as the server, so the row that brings |nanoflash - SGLang| down to the FP8 floor names
the difference. Nothing in nanoflash is edited: each variant is a context manager that patches one attribute or
method and restores it.

Why these (issue 20, run 7: past position 128 SGLang sits 4-8x off nanoflash's FP8 floor, below 128 on it; a
source audit of SGLang 0.5.16 found its window, C128 pooling / state / RoPE / FP8 store / causality / gather and
the C4 overlap all official):

* `shared_expert_clamp` -- the one code difference found that can act there: SGLang builds the shared expert as a
  `DeepseekV2MLP(..., swiglu_limit=config.swiglu_limit)` (srt/models/deepseek_v2.py:725-732), so it clamps
  gate <= 10 and |up| <= 10 there too; official and nanoflash clamp the routed experts only. It only acts on
  tokens whose shared-expert pre-activations pass the limit (`shared_expert_stats` counts them).
  Since 2026-12-07 the experiment's model clamps it as SGLang does (`ModelConfig.shared_expert_clamp`, h200.txt);
  `shared_expert_no_clamp` is then the row that shows what the clamp moves (the published model's semantics).
* `no_c128_entries` -- a bound: the ratio > 4 layers attend to no compressed entry (what an unusable C128 entry
  would do; it changes positions >= ratio - 1 only).
* `window_127`, `window_129` -- controls: the window off by one either way (the largest mechanical effect an
  off-by-one there could have).
* `fp8_index_scores` -- issue 42: nanoflash with its C4 indexer scoring in FP8 as SGLang 0.5.16 does on Hopper
  (`ModelConfig.indexer_quant="fp8"`, `quant.fp8_index_sim`), everything else bf16: the row that meets the floor
  past 2048 if the top-512 SGLang keeps is the difference; `fp8_index_scores_layer<L>` the same in C4 layer L
  only (which layer's selection matters).
"""
import contextlib
import dataclasses

import torch

import nanoflash.model as M

_COMPRESSED_KEYS = M.Attention.compressed_keys


@contextlib.contextmanager
def _set(objs, name, value):
    old = [getattr(o, name) for o in objs]
    for o in objs:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, v in zip(objs, old):
            setattr(o, name, v)


def _no_c128_keys(self, x, qr, start_pos, cache, fast=False, kept=None):
    """`Attention.compressed_keys` with every entry of a ratio > 4 layer dropped (index -1 / mask False)."""
    comp, keep = _COMPRESSED_KEYS(self, x, qr, start_pos, cache, fast, kept)
    if self.ratio > 4:
        keep = torch.full_like(keep, -1) if fast else torch.zeros_like(keep)
    return comp, keep


def variants(model) -> dict:
    """name -> a zero-argument context manager under which `model`'s forward has that one change."""
    cfg = model.cfg
    shared = [m.shared_experts for m in model.modules() if isinstance(m, M.MoE)]
    out = {
        "shared_expert_clamp": lambda: _set(shared, "swiglu_limit", cfg.swiglu_limit),
        "shared_expert_no_clamp": lambda: _set(shared, "swiglu_limit", 0.0),
        "no_c128_entries": lambda: _set([M.Attention], "compressed_keys", _no_c128_keys),
        "window_127": lambda: _set([cfg], "window_size", cfg.window_size - 1),
        "window_129": lambda: _set([cfg], "window_size", cfg.window_size + 1),
        "fp8_index_scores": lambda: _set([cfg], "indexer_quant", "fp8"),
    }
    fp8 = dataclasses.replace(cfg, indexer_quant="fp8")   # one layer's indexer (and its compressor) only
    for name, mod in model.named_modules():
        if isinstance(mod, M.Indexer):
            out[f"fp8_index_scores_layer{name.split('.')[1]}"] = \
                lambda mod=mod: _set([mod, mod.compressor], "cfg", fp8)
    return out


@contextlib.contextmanager
def shared_expert_stats(model, out: list):
    """While active, every forward appends, per MoE layer, the per-token max of the shared expert's gate w1 x and
    max |w3 x| to `out`: {"layer": name, "g_max": [N], "u_absmax": [N]} (CPU fp32, N = batch x tokens). A token
    above `cfg.swiglu_limit` in either is one where SGLang's clamp changes the output."""
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, M.MoE):
            def hook(ex, inp, _out, name=name):
                g, u = ex.w1(inp[0]).float(), ex.w3(inp[0]).float()
                out.append({"layer": name, "g_max": g.amax(-1).flatten().cpu(),
                            "u_absmax": u.abs().amax(-1).flatten().cpu()})
            hooks.append(mod.shared_experts.register_forward_hook(hook))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def score(model, samples, server, rows: dict, names: list, logprobs) -> tuple[torch.Tensor, torch.Tensor]:
    """rows["bf16_<name>"] = |logprobs(model under variant name) - server| per token for each of `names`; returns
    (pos, over) over every input position of every sample: over[i] whether a shared-expert pre-activation passes
    cfg.swiglu_limit in some layer there (where SGLang's clamp acts). `samples`: (prompt, ids, logprobs) triples,
    `logprobs(model, samples)` -> [tokens], as `sglang_check.our_logprobs`."""
    for name in names:
        with variants(model)[name]():
            rows["bf16_" + name] = (logprobs(model, samples) - server).abs()
    over, lim = [], model.cfg.swiglu_limit
    for prompt, ids, _ in samples:
        stats = []
        with shared_expert_stats(model, stats):
            logprobs(model, [(prompt, ids, None)])
        over.append(torch.stack([(r["g_max"] > lim) | (r["u_absmax"] > lim) for r in stats]).any(0))  # [S-1]
    return torch.cat([torch.arange(len(o)) for o in over]), torch.cat(over)

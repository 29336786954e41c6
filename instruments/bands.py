"""The train-rollout gap by position band, against the FP8 floor measured on the same tokens in each band.

V4's attention changes regime with the position t of the query whose logits score a token (a response token
at absolute position p is scored by the query at t = p - 1):

    window   t < W (= window_size, 128)         every key is inside the sliding window
    c4_all   W <= t < 4 K (K = index_topk, 512)  keys beyond the window come only from compressed entries; the
                                                 C4 layers keep every visible entry ((t + 1) // 4 <= K)
    c4_topk  t >= 4 K (2048)                     the lightning indexer's top-K selects among the C4 entries

(C128 entries exist from t = 127 on, so in both upper bands.) A server that agrees with the trainer on short
sequences but not where the selection or the compressed entries carry the context shows here, band by band,
as a gap above that band's floor. Per step (`band_stats`, from the live check's per-token values): each band's
token count, share of the step's scored tokens, mean |gap| and floor and their ratio. Over a run
(`summarize`): token-weighted means and shares, and per band the excess gap - floor against the step: its
least-squares slope with a 95% interval (no increasing drift: the interval contains 0 or lies below it) and
its post-push jumps (each step against the steps before it, `runstats.jumps`; no jump: every |z| <= 3).

    bands.edges(cfg)                               # (128, 2048) for V4's geometry
    bands.band_stats(gap, floor, qpos, cfg)        # one step -> {"band_window_gap_mean": ..., ...}
    bands.summarize(train_records)                 # the run -> per band means, drift, jumps, bars

Tests: `pytest experiments/h200/test_long.py -q`.
"""
from __future__ import annotations

import torch

BANDS = ("window", "c4_all", "c4_topk")
FLOOR_BAR = 1.2        # issue 42: mean |dlogp| within 1.2x the FP8 floor overall and in each band
SHARE_BAR = 0.5        # issue 42: >= 50% of scored response tokens at positions >= 2048 (the c4_topk band)
METRICS = ("tokens", "share", "gap_mean", "floor_mean", "gap_over_floor")


def edges(cfg) -> tuple:
    """(W, 4 K): the band edges of a model config, in query positions."""
    return cfg.window_size, 4 * cfg.index_topk


def band_index(qpos: torch.Tensor, cfg) -> torch.Tensor:
    """0 / 1 / 2 (BANDS) of each query position. [N] int -> [N] int64"""
    w, sel = edges(cfg)
    return (qpos >= w).long() + (qpos >= sel).long()


def band_stats(gap: torch.Tensor, floor: torch.Tensor, qpos: torch.Tensor, cfg) -> dict:
    """One step's numbers per band from per-token values over its scored tokens (1-D, same order): gap =
    log p_train - log p_rollout, floor = the FP8 floor's |dlogp|, qpos = the query position. Keys
    band_<name>_<metric> (METRICS); the gap and floor means and the ratio are left out of an empty band."""
    b, n, out = band_index(qpos, cfg), max(len(qpos), 1), {}
    for i, name in enumerate(BANDS):
        m = b == i
        k = int(m.sum())
        out[f"band_{name}_tokens"], out[f"band_{name}_share"] = k, k / n
        if k:
            g, f = float(gap[m].abs().double().mean()), float(floor[m].double().mean())
            out.update({f"band_{name}_gap_mean": g, f"band_{name}_floor_mean": f,
                        f"band_{name}_gap_over_floor": g / max(f, 1e-12)})
    return out


def summarize(train: list) -> dict:
    """The run's band numbers from its `train` records (the keys `band_stats` wrote): per band the token-weighted
    gap and floor means, their ratio, the share of scored tokens, the excess gap - floor per step against the
    step (slope, 95% interval, `increasing`: the interval lies above 0) and its jumps; `bars` for issue 42.
    Steps whose record lacks a band (no tokens there) are left out of that band's series."""
    from instruments.runstats import jumps, ols
    total = sum(r.get(f"band_{b}_tokens", 0) for r in train for b in BANDS)
    out, bars = {}, {}
    for b in BANDS:
        rows = [r for r in train if r.get(f"band_{b}_tokens", 0) > 0 and f"band_{b}_gap_mean" in r]
        n = sum(r[f"band_{b}_tokens"] for r in rows)
        res = {"tokens": n, "share": n / total if total else 0.0, "steps": len(rows)}
        if n:
            g = sum(r[f"band_{b}_gap_mean"] * r[f"band_{b}_tokens"] for r in rows) / n
            f = sum(r[f"band_{b}_floor_mean"] * r[f"band_{b}_tokens"] for r in rows) / n
            res.update(gap_mean=g, floor_mean=f, gap_over_floor=g / max(f, 1e-12))
            bars[f"{b}_within_{FLOOR_BAR}x_floor"] = g <= FLOOR_BAR * f
        if len(rows) >= 3:
            steps = [r["step"] for r in rows]
            excess = [r[f"band_{b}_gap_mean"] - r[f"band_{b}_floor_mean"] for r in rows]
            fit, jmp = ols(steps, excess), jumps(excess)
            jmp["over_steps"] = [steps[i] for i in jmp["over_at"]]
            res.update(excess_drift=fit, excess_increasing=fit["ci95"][0] > 0, excess_jumps=jmp)
            bars[f"{b}_no_increasing_excess_drift"] = fit["ci95"][0] <= 0
            bars[f"{b}_no_excess_jump"] = jmp["over"] == 0
        out[b] = res
    out["share_c4_topk"] = out["c4_topk"]["share"]
    bars[f"share_c4_topk_>=_{SHARE_BAR}"] = out["share_c4_topk"] >= SHARE_BAR
    out["bars"] = bars
    return out

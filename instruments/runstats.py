"""The statistics and figures of a live GRPO run (issue 20's bars), read back from its `metrics.jsonl`.

    python -m instruments.runstats runs/h200 experiments/h200        # summary.json + five PNGs

Statistics (pure functions, tested against hand-computed values):

* `ols(xs, ys)`: least squares y = a + b x with the slope's standard error
  se_b = sqrt(sum r^2 / (n - 2) / sum (x - mean x)^2) and its 95% interval b +- t_{0.975, n-2} se_b
  (`t_quantile`: the Cornish-Fisher expansion of Student's t around the normal quantile, good to ~1e-3 at
  n - 2 >= 5). *Drift*: the interval of the per-step mean |dlogp| slope contains 0.
* `jumps(ys)`: every step after a push (here every step) against the steps before it: z_i = (y_i - m_i) /
  (s_i sqrt(1 + 1/n_i)), with m_i, s_i the mean and standard deviation of y_1..y_{i-1} (n_i >= MIN_PRIOR):
  the prediction error of a new point, in its own standard errors. *No jump*: every |z_i| <= JUMP_Z.
* `floor_context`: the slope and the jumps of gap - floor (what the server adds beyond FP8 rounding, which falls
  with the entropy as the gap does), the floor's own jumps, gap / floor per third of the run and over the run on
  the tokens above each step's median entropy (`live.token_stats`); reported beside the bars, not as one.
* `drift_power`: the smallest change of the gap over the run the drift test resolves, and with the entropy, how
  far the policy's entropy may move before a gap that scales with it reads as drift.
* `excess_by_token`: from the per-token files the live checks keep (`live_tokens/step_NNNN.pt`), the excess
  sum(|gap| - floor) per token id and at each response's first token vs the rest: which tokens carry a gap the
  FP8 floor does not explain (over all steps, and over the steps above FLOOR_BAR).
* `jump_tokens`: for each step over the jump bar, its largest-|gap| token and the step's means without it
  (is the jump one rare token the FP8 floor carries too?).
* reward slope: `ols` on the per-step reward; pass@1 gain: the paired difference against the warm start
  re-evaluated on the same seeds (`live.LiveChecks.eval_warm`: gain, SE, z).
* when the steps logged them (issue 42, `live.LiveChecksLong`): `bands` (`instruments.bands.summarize`: the gap
  and floor per position band, the excess's drift and jumps per band, the share of tokens at >= 2048),
  `indexer_agreement` (`agreement_summary`: per C4 layer the overlap of the exact and FP8-score top-k sets;
  `indexer_agreement_server` and `_server_fp8`: the exact and the FP8-score sets against SGLang's own, when
  the server reported them),
  `rollout_truncated_frac_mean` (responses cut at rollout.max_new_tokens).

Figures: dlogp.png (mean |dlogp| per step with its p99, the FP8 floor, the pushes marked, the warm-start swap
pushes of eval points marked), reward.png (per step, 5-step moving average, linear fit), passk.png (pass@k per
eval, and the warm start's pass@1 +- 3 SE), time.png (stacked per-step split: rollout / recompute / train /
push / live checks / eval), memory.png (trainer allocated and peak, whole GPU used with the server).

Tests: `pytest experiments/h200/test_h200_pieces.py -q`.
"""
from __future__ import annotations

import json
import math
import os
import sys

from nanoflash.rl.metrics import read_jsonl
from nanoflash.rl.plots import linear_fit

JUMP_Z = 3.0     # issue 20: a post-push step more than 3 standard errors from the steps before it is a jump
MIN_PRIOR = 3    # steps needed before one can be tested for a jump
GAP_BAR = 0.09   # the reference run's bounded mean |dlogp|
FLOOR_BAR = 1.2  # mean |dlogp| within 1.2x of the FP8 noise floor on the same tokens
GAIN_BAR = 0.15  # held-out pass@1 up by >= 15 points ...
GAIN_Z_BAR = 3.0  # ... by more than 3 standard errors
EXCESS_TOP = 12  # token ids listed by excess_by_token


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal quantile z_p."""
    z = _normal_quantile(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def _normal_quantile(p: float) -> float:
    """Inverse normal CDF by bisection on math.erf (exact to 1e-12; no scipy)."""
    lo, hi = -12.0, 12.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ols(xs: list, ys: list) -> dict:
    """Least-squares line with the slope's standard error and 95% interval (n >= 3)."""
    n = len(xs)
    if n < 3:
        raise ValueError(f"a slope with an interval needs >= 3 points, got {n}")
    a, b = linear_fit(xs, ys)
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    se = math.sqrt(sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / (n - 2) / sxx)
    t = t_quantile(0.975, n - 2)
    return {"intercept": a, "slope": b, "slope_se": se, "ci95": [b - t * se, b + t * se], "n": n}


def jumps(ys: list) -> dict:
    """Each point against the ones before it (see the module docstring) -> max |z|, where, how many > JUMP_Z."""
    zs = []
    for i in range(MIN_PRIOR, len(ys)):
        prior = ys[:i]
        m = sum(prior) / i
        s = math.sqrt(sum((y - m) ** 2 for y in prior) / (i - 1))
        zs.append((ys[i] - m) / (s * math.sqrt(1 + 1 / i)) if s > 0 else 0.0)
    worst = max(range(len(zs)), key=lambda j: abs(zs[j])) if zs else None
    return {"tested": len(zs), "max_abs_z": abs(zs[worst]) if zs else 0.0,
            "at_index": worst + MIN_PRIOR if zs else None, "over": sum(abs(z) > JUMP_Z for z in zs),
            "over_at": [j + MIN_PRIOR for j, z in enumerate(zs) if abs(z) > JUMP_Z]}


def floor_context(steps: list, gap: list, floor: list, gap_hi: list = (), floor_hi: list = ()) -> dict:
    """What the gap does beyond the FP8 floor measured on the same tokens (not a bar; the context of two): the
    slope of gap - floor per step (a policy that sharpens lowers both, so the gap's own slope mixes the server's
    error with the entropy), gap / floor (ratio of means) over each third of the run, and, when the steps logged
    them (`live.token_stats`, from run 5 on), gap / floor over the tokens above each step's median entropy.
    Jumps likewise: `excess_jumps` tests gap - floor, `floor_jumps` the floor (a batch whose rare tokens move the
    FP8 floor moves the gap with it; a push that breaks the server moves the gap alone)."""
    excess = ols(steps, [g - f for g, f in zip(gap, floor)])
    cuts = [round(len(gap) * i / 3) for i in range(4)]
    thirds = [sum(gap[a:b]) / sum(floor[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a and sum(floor[a:b]) > 0]
    out = {"excess_drift": excess, "excess_drift_ci_contains_0": excess["ci95"][0] <= 0 <= excess["ci95"][1],
           "gap_over_floor_thirds": thirds, "excess_jumps": jumps([g - f for g, f in zip(gap, floor)]),
           "floor_jumps": jumps(floor)}
    if len(gap_hi) == len(gap) and len(floor_hi) == len(gap) and sum(floor_hi) > 0:
        out["gap_over_floor_high_entropy"] = sum(gap_hi) / sum(floor_hi)
    return out


def drift_power(steps: list, gap: list, entropy: list = ()) -> dict:
    """What the drift test can see (context of the bar): `resolution`, the smallest change of the gap over the
    run, (last step - first step) x slope, whose 95% interval excludes 0 at this run's scatter (t x se_b x span),
    also as a share of the mean gap; with the steps' mean entropy H, the gap per nat (`ols(H, gap)` slope), the
    entropy's change over the run by its own fit, and `entropy_budget_nat` = resolution / gap per nat: how far the
    policy's entropy may move before a gap that scales with it reads as drift."""
    fit, span = ols(steps, gap), max(steps) - min(steps)
    res = t_quantile(0.975, fit["n"] - 2) * fit["slope_se"] * span
    out = {"resolution": res, "resolution_share": res / (sum(gap) / len(gap))}
    if len(entropy) == len(gap):
        per_nat = ols(entropy, gap)["slope"]
        out.update({"gap_per_nat": per_nat, "entropy_change": ols(steps, entropy)["slope"] * span,
                    "entropy_budget_nat": res / abs(per_nat) if per_nat else None})
    return out


def excess_by_token(dump_dir: str, steps: list | None = None, top: int = EXCESS_TOP, decode=None) -> dict:
    """Where sum(|gap| - floor) lives, over the steps' per-token files (all, or `steps`): per token id (the `top`
    largest excesses: count, |gap| and floor sums, share of the total excess; `decode(id)` -> its text) and at
    the responses' first tokens (pos 0) against the rest. With the server's prefill scores in the files
    (`prefill_gap`), each row and part also gives them: prefill_over_floor near 1 where gap_over_floor is not puts
    the excess in the server's decode."""
    import torch
    files = sorted(f for f in os.listdir(dump_dir) if f.startswith("step_"))                # step_NNNN.pt
    keep = None if steps is None else set(steps)
    cols = [torch.load(os.path.join(dump_dir, f)) for f in files if keep is None or int(f[5:9]) in keep]
    if not cols:
        return {"steps": 0}
    keys = ("gap", "floor", "token", "pos") + (("prefill_gap",) if all("prefill_gap" in c for c in cols) else ())
    cat = {k: torch.cat([c[k] for c in cols]) for k in keys}
    gap, floor, tok = cat["gap"].double().abs(), cat["floor"].double(), cat["token"].long()
    pre = cat["prefill_gap"].double().abs() if "prefill_gap" in cat else None   # the server's prefill vs trainer
    total = float((gap - floor).sum())
    ids, inv = tok.unique(return_inverse=True)
    sums = [torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, v)
            for v in (gap, floor) + ((pre,) if pre is not None else ())]
    count = torch.bincount(inv, minlength=len(ids))
    order = (sums[0] - sums[1]).argsort(descending=True)[:top]
    rows = [{"token": int(ids[i]), "n": int(count[i]), "gap_sum": float(sums[0][i]), "floor_sum": float(sums[1][i]),
             "excess_share": float(sums[0][i] - sums[1][i]) / total if total else 0.0} for i in order]
    for r, i in zip(rows, order):
        if pre is not None:
            r["prefill_sum"] = float(sums[2][i])
        if decode is not None:
            r["text"] = decode(r["token"])
    first = cat["pos"] == 0

    def part(m):
        out = {"n": int(m.sum()), "gap_over_floor": float(gap[m].sum() / floor[m].sum()) if m.any() else None,
               "excess_share": float((gap[m] - floor[m]).sum()) / total if total else 0.0}
        if pre is not None:
            out["prefill_over_floor"] = float(pre[m].sum() / floor[m].sum()) if m.any() else None
        return out
    res = {"steps": len(cols), "tokens": len(gap), "excess_sum": total, "by_token": rows,
           "first_token": part(first), "rest": part(~first)}
    if pre is not None:
        res["all"] = part(first | ~first)
    return res


def jump_tokens(dump_dir: str, steps: list, decode=None) -> list:
    """Per step in `steps` (the jumps), from its per-token file: the token with the largest |gap| (id, position,
    entropy, |gap|, its floor) and the step's mean |gap| and floor with and without it. A jump that one token
    carries, with |gap| near that token's floor, is FP8 rounding of a rare token that nanoflash's own FP8 model
    reproduces, not a push the server took wrongly (that moves the gap on every token, the floor on none)."""
    import torch
    out = []
    for step in steps:
        path = os.path.join(dump_dir, f"step_{step:04d}.pt")
        if not os.path.exists(path):
            continue
        d = torch.load(path)
        gap, floor = d["gap"].double().abs(), d["floor"].double()
        i, n = int(gap.argmax()), len(gap)
        top = {"token": int(d["token"][i]), "pos": int(d["pos"][i]), "gap": float(gap[i]), "floor": float(floor[i])}
        if "entropy" in d:
            top["entropy"] = float(d["entropy"][i])
        if decode is not None:
            top["text"] = decode(top["token"])
        out.append({"step": step, "tokens": n, "gap_mean": float(gap.mean()), "floor_mean": float(floor.mean()),
                    "top": top, **{f"{k}_mean_without": float((v.sum() - v[i]) / (n - 1)) if n > 1 else None
                                   for k, v in (("gap", gap), ("floor", floor))}})
    return out


def column(recs: list, key: str, kind: str | None = None) -> tuple[list, list]:
    """(steps, values) of `key` in the records (of `kind` only, if given), skipping non-numbers."""
    pts = [(r["step"], r[key]) for r in recs
           if (kind is None or r.get("kind") == kind) and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def agreement_summary(train: list, prefix: str = "agree") -> dict:
    """Per C4 layer, the run's indexer agreement (`live.LiveChecksLong`'s <prefix>_<layer>_* keys: `agree`, the
    exact sets against the FP8 reproduction; `server_agree` / `server_fp8_agree`, either against SGLang's own):
    position-weighted mean overlap and identical share, the smallest overlap seen, steps and positions measured."""
    head = f"{prefix}_"
    layers = sorted({k[len(head):].split("_")[0] for r in train for k in r
                     if k.startswith(head) and k.endswith("_positions")})
    out = {}
    for L in layers:
        key = lambda name: f"{head}{L}_{name}"  # noqa: E731
        rows = [r for r in train if r.get(key("positions"), 0) > 0]
        n = sum(r[key("positions")] for r in rows)
        if n:
            out[f"layer_{L}"] = {
                "steps": len(rows), "positions": n,
                "overlap_mean": sum(r[key("overlap_mean")] * r[key("positions")] for r in rows) / n,
                "identical_share": sum(r[key("identical_share")] * r[key("positions")] for r in rows) / n,
                "swapped_mean": sum(r[key("swapped_mean")] * r[key("positions")] for r in rows) / n,
                "overlap_min": min(r[key("overlap_min")] for r in rows)}
    return out


def summarize(recs: list) -> dict:
    """The bars of issue 20 from a run's records."""
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    warm = [r for r in recs if r.get("kind") == "eval_warm"]
    pushes = [r for r in recs if r.get("kind") == "push"] + train
    s, gap = column(train, "gap_mean")
    _, floor = column(train, "floor_mean")
    _, reward = column(train, "reward_mean")
    out = {"steps": len(train), "gap_mean": sum(gap) / len(gap) if gap else None,
           "floor_mean": sum(floor) / len(floor) if floor else None}
    if gap and floor:
        out["gap_over_floor"] = out["gap_mean"] / out["floor_mean"]
    _, floor8 = column(train, "floor_fp8_mean")   # FP8 rounding only (runs 3-6 measured this floor)
    if gap and len(floor8) == len(gap):
        out["floor_fp8_mean"] = sum(floor8) / len(floor8)
        out["gap_over_floor_fp8"] = out["gap_mean"] / out["floor_fp8_mean"]
    if len(gap) >= 3:
        out["gap_drift"], out["gap_jumps"] = ols(s, gap), jumps(gap)
        out["drift_power"] = drift_power(s, gap, column(train, "entropy_mean")[1])
    if len(gap) >= 3 and len(floor) == len(gap):
        out["context"] = floor_context(s, gap, floor, column(train, "gap_high_entropy_mean")[1],
                                       column(train, "floor_high_entropy_mean")[1])
    if len(reward) >= 3:
        out["reward_slope"] = ols(column(train, "reward_mean")[0], reward)
    out["pushes"] = len(pushes) + sum(r.get("swap_pushes", 0) for r in warm)   # + the warm-start swaps
    out["pushes_verified"] = sum(1 for r in pushes if r.get("verify_servers", 0) >= 1 and "probe_mean" in r) + \
        sum(r.get("swap_pushes_verified", 0) for r in warm)
    out["probe_max_mean"] = max((r["probe_mean"] for r in pushes if "probe_mean" in r), default=None)
    out["evals"] = [{k: r.get(k) for k in ("step", "pass@1", "pass@2", "pass@4", "pass@8", "pass@1_se",
                                          "truncation_rate")} for r in evals]
    out["warm"] = [{k: r.get(k) for k in ("step", "warm_pass@1", "pass@1", "gain_pass@1", "gain_se", "gain_z",
                                         "warm_truncation_rate")} for r in warm]
    last = warm[-1] if warm else {}
    timing = ("rollout_s", "logprobs_s", "train_s", "sync_s", "live_s", "probe_s", "step_s")
    out["time_mean_s"] = {k: sum(column(train, k)[1]) / max(len(column(train, k)[1]), 1) for k in timing}
    if any("band_window_tokens" in r for r in train):   # the position bands (instruments.bands), from issue 42
        from instruments import bands
        out["bands"] = bands.summarize(train)
    for name, prefix in (("indexer_agreement", "agree"), ("indexer_agreement_server", "server_agree"),
                         ("indexer_agreement_server_fp8", "server_fp8_agree")):
        agree = agreement_summary(train, prefix)
        if agree:
            out[name] = agree
    for key in ("server_topk_errors", "server_topk_unreplayable"):   # LiveChecksLong's counts, run-long: the last
        _, counts = column(train, key)
        if counts:
            out[key] = counts[-1]
    _, trunc = column(train, "truncated_frac")
    if trunc:
        out["rollout_truncated_frac_mean"] = sum(trunc) / len(trunc)
    out["bars"] = {
        "steps": len(train),
        "gap_mean_below_0.09": out.get("gap_mean") is not None and out["gap_mean"] < GAP_BAR,
        "gap_within_1.2x_floor": out.get("gap_over_floor") is not None and out["gap_over_floor"] <= FLOOR_BAR,
        "no_drift": "gap_drift" in out and out["gap_drift"]["ci95"][0] <= 0 <= out["gap_drift"]["ci95"][1],
        "no_jump": "gap_jumps" in out and out["gap_jumps"]["over"] == 0,
        "pass@1_gain_>=_0.15_and_>3se": bool(last) and last["gain_pass@1"] >= GAIN_BAR and last["gain_z"] > GAIN_Z_BAR,
        "every_push_verified": out["pushes"] > 0 and out["pushes_verified"] == out["pushes"],
        "reward_slope_positive": "reward_slope" in out and out["reward_slope"]["slope"] > 0,
    }
    return out


def report(run_dir: str, out_dir: str, extra: dict | None = None, draw: bool = True, decode=None) -> dict:
    """summary.json (+ the contents of `extra` {name: json path}, + `excess_by_token` when the run kept its
    per-token files; `decode(id)` names the tokens) and the figures, under out_dir."""
    recs = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    summary = summarize(recs)
    dump = os.path.join(run_dir, "live_tokens")
    if os.path.isdir(dump) and os.listdir(dump):
        over = [r["step"] for r in recs if r.get("kind") == "train" and r.get("gap_over_floor", 0) > FLOOR_BAR]
        summary["excess_tokens"] = {"all_steps": excess_by_token(dump, decode=decode),
                                    "steps_over_floor_bar": excess_by_token(dump, over, decode=decode)}
        steps = column(recs, "gap_mean", "train")[0]   # a jump's index -> its step: the gap's and the excess's
        at = set(summary.get("gap_jumps", {}).get("over_at", [])) | \
            set(summary.get("context", {}).get("excess_jumps", {}).get("over_at", []))
        summary["jump_tokens"] = jump_tokens(dump, [steps[i] for i in sorted(at)], decode=decode)
    summary["startup"] = [{k: v for k, v in r.items() if k != "kind"} for r in recs if r["kind"] == "startup"]
    summary["server_restarts"] = [r["step"] for r in recs if r["kind"] == "server_restart"]
    for name, path in (extra or {}).items():
        if path and os.path.exists(path):
            with open(path) as f:
                summary[name] = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    summary["figures"] = figures(recs, out_dir, summary) if draw else []
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def figures(recs: list, out_dir: str, summary: dict) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("runstats: matplotlib is not installed; no figures", file=sys.stderr)
        return []
    from instruments import runstats_plots
    return runstats_plots.draw(plt, recs, out_dir, summary)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m instruments.runstats RUN_DIR OUT_DIR")
    print(json.dumps(report(sys.argv[1], sys.argv[2])["bars"], indent=1))

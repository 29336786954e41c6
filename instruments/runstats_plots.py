"""The five figures of a live GRPO run (issue 20), drawn from its metrics records (`runstats.figures`).

    dlogp.png   mean |dlogp| per step (p99 shaded line), the FP8 floor on the same tokens, a tick per push,
                the eval points (where the warm start was swapped in and out) marked
    reward.png  rollout reward per step, 5-step moving average, least-squares line (slope in the legend)
    passk.png   pass@1/2/4/8 per eval; the warm start's pass@1 re-evaluated at each eval point, +- 3 SE
    time.png    per-step seconds stacked: rollout, recompute (old log-probs), train, push, live checks, eval
    memory.png  trainer allocated / peak GiB (torch) and the whole GPU's used GiB (trainer + SGLang)

Tests: `pytest experiments/h200/test_h200_pieces.py -q` (drawn on a tiny run).
"""
from __future__ import annotations

import os

from nanoflash.rl.plots import linear_fit, moving_average
from instruments.runstats import column


def _save(plt, fig, out_dir, name) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def dlogp(plt, recs, out_dir, summary) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    s, g = column(recs, "gap_mean", "train")
    ax.plot(s, g, "o-", ms=3, label=f"SGLang vs trainer, mean (run mean {summary.get('gap_mean') or 0:.4f})")
    ax.plot(*column(recs, "gap_p99", "train"), ":", alpha=0.6, label="SGLang vs trainer, p99")
    ax.plot(*column(recs, "floor_mean", "train"), "s--", ms=3,
            label=f"FP8 floor: nanoflash as served (FP8-sim) vs plain (mean {summary.get('floor_mean') or 0:.4f})")
    if summary.get("floor_fp8_mean") is not None:   # FP8 rounding only, the fp32 weights kept (runs 3-6)
        ax.plot(*column(recs, "floor_fp8_mean", "train"), ":", lw=1,
                label=f"FP8 weights only (mean {summary['floor_fp8_mean']:.4f})")
    for st in s:
        ax.axvline(st, color="0.85", lw=0.5, zorder=0)
    for st in [r["step"] for r in recs if r.get("kind") == "eval_warm" and r["step"] > 0]:
        ax.axvline(st + 0.5, color="tab:red", lw=0.8, ls="--", zorder=0)
    if "gap_drift" in summary:
        d = summary["gap_drift"]
        ax.plot(s, [d["intercept"] + d["slope"] * x for x in s], "k-", lw=0.8,
                label=f"fit slope {d['slope']:.2e}/step, 95% CI [{d['ci95'][0]:.1e}, {d['ci95'][1]:.1e}]")
    if any(v > 0 for v in g):
        ax.set_yscale("log")
    ax.set(xlabel="GRPO step (grey: a verified push before the step; red dashed: warm-start swap pushes)",
           ylabel="|log p_train - log p_rollout| per token", title="train-rollout log-prob gap per step")
    ax.legend(fontsize=7)
    return _save(plt, fig, out_dir, "dlogp.png")


def reward(plt, recs, out_dir, summary) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    s, r = column(recs, "reward_mean", "train")
    a, b = linear_fit(s, r)
    ax.plot(s, r, "o", ms=3, alpha=0.6, label="reward per step (all samples seen)")
    ax.plot(s, moving_average(r, 5), "-", label="5-step moving average")
    ax.plot(s, [a + b * x for x in s], "k--", label=f"linear fit, slope {b:+.4f}/step")
    ax.set(xlabel="GRPO step", ylabel="mean reward", title="rollout reward")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "reward.png")


def passk(plt, recs, out_dir, summary) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    for k in (1, 2, 4, 8):
        s, v = column(recs, f"pass@{k}", "eval")
        if s:
            ax.plot(s, v, "o-", label=f"pass@{k}")
    warm = [r for r in recs if r.get("kind") == "eval_warm"]
    if warm:
        s = [r["step"] for r in warm]
        w = [r["warm_pass@1"] for r in warm]
        se = [r.get("gain_se", 0) for r in warm]
        ax.errorbar(s, w, yerr=[3 * e for e in se], fmt="k--", capsize=3,
                    label="warm start pass@1, same seeds (bars: 3 SE of the paired gain)")
    ax.set(xlabel="GRPO step", ylabel="held-out", ylim=(0, 1), title="pass@k on held-out problems (SGLang)")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "passk.png")


def timesplit(plt, recs, out_dir, summary) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    train = [r for r in recs if r.get("kind") == "train"]
    ev = {r["step"]: r.get("eval_s", 0) for r in recs if r.get("kind") == "eval"}
    for r in recs:
        if r.get("kind") == "eval_warm":
            ev[r["step"]] = ev.get(r["step"], 0) + r.get("warm_eval_s", 0)
    s = [r["step"] for r in train]
    parts = {"rollout": [r.get("rollout_s", 0) for r in train],
             "recompute": [r.get("logprobs_s", 0) for r in train],
             "train": [r.get("train_s", 0) - r.get("logprobs_s", 0) - r.get("live_s", 0) for r in train],
             "push (verified)": [r.get("sync_s", 0) for r in train],
             "live checks": [r.get("live_s", 0) + r.get("probe_s", 0) for r in train],
             "eval (+ warm re-eval)": [ev.get(x, 0) for x in s]}
    bottom = [0.0] * len(s)
    for name, v in parts.items():
        ax.bar(s, v, bottom=bottom, label=name, width=0.8)
        bottom = [b + x for b, x in zip(bottom, v)]
    ax.set(xlabel="GRPO step", ylabel="seconds", title="time per step")
    ax.legend(fontsize=7, ncol=3)
    return _save(plt, fig, out_dir, "time.png")


def memory(plt, recs, out_dir, summary) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, label in (("gpu_mem_gib", "trainer allocated"), ("gpu_peak_gib", "trainer peak"),
                       ("gpu_used_total_gib", "whole GPU used (trainer + SGLang)")):
        s, v = column(recs, key, "train")
        if s:
            ax.plot(s, v, "o-", ms=3, label=label)
    ax.set(xlabel="GRPO step", ylabel="GiB", title="GPU memory")
    if ax.lines:  # a CPU run logs no GPU memory: an empty figure, no empty legend
        ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "memory.png")


def draw(plt, recs, out_dir, summary) -> list:
    return [f(plt, recs, out_dir, summary) for f in (dlogp, reward, passk, timesplit, memory)]

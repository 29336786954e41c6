"""PNG figures of a run, read back from `metrics.jsonl` (the figures of the reference run's report).

    reward.png      rollout reward per step, its moving average over `window` steps, and the least-squares
                    line r(t) = a + b t (slope b printed in the legend: reward gained per step)
    logprob.png     train/rollout mean |delta logp| per step (`train_rollout_logprob_abs_diff`), log scale
                    when it is positive (an exact 0, the matched-precision mode, is drawn on a linear axis)
    passk.png       eval pass@k over steps, one line per k

    python -m nanoflash.plots runs/demo          # writes runs/demo/plots/*.png

matplotlib is optional: without it `write_plots` prints one note and returns []. The Agg backend is used,
so no display is needed.

Tests: `pytest tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

import os
import sys

from nanoflash.metrics import read_jsonl


def moving_average(xs: list[float], window: int) -> list[float]:
    """m_t = mean(x_{max(0, t-w+1)} .. x_t): the trailing mean (shorter at the start)."""
    out, acc = [], 0.0
    for t, x in enumerate(xs):
        acc += x
        if t >= window:
            acc -= xs[t - window]
        out.append(acc / min(t + 1, window))
    return out


def linear_fit(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b t: b = cov(t, y) / var(t), a = mean(y) - b mean(t). Returns (a, b)."""
    n = len(ts)
    if n < 2:
        return (ys[0] if ys else 0.0), 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0
    return my - b * mt, b


def _series(recs, key):
    pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_plots(run_dir: str, window: int = 5) -> list[str]:
    """Write reward.png, logprob.png and passk.png under run_dir/plots; returns the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed; no PNG figures", file=sys.stderr)
        return []
    path = os.path.join(run_dir, "metrics.jsonl")
    train, ev = read_jsonl(path, "train"), read_jsonl(path, "eval")
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    t, r = _series(train, "reward_mean")
    if t:
        a, b = linear_fit(t, r)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(t, r, ".", alpha=0.5, label="reward (rollout mean)")
        ax.plot(t, moving_average(r, window), "-", label=f"moving average ({window} steps)")
        ax.plot(t, [a + b * x for x in t], "--", label=f"linear fit: {b:+.4f}/step")
        ax.set(xlabel="step", ylabel="reward", title="rollout reward")
        ax.legend(fontsize=8)
        save(fig, "reward.png")
    t, d = _series(train, "train_rollout_logprob_abs_diff")
    if t:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(t, d, "o-", ms=3)
        if min(d) > 0:
            ax.set_yscale("log")
        ax.set(xlabel="step", ylabel="mean |logp_train - logp_rollout|", title="train/rollout log-prob mismatch")
        save(fig, "logprob.png")
    ks = sorted({k for rec in ev for k in rec if k.startswith("pass@") and k[5:].isdigit()}, key=lambda k: int(k[5:]))
    if ks:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in ks:
            ax.plot(*_series(ev, k), "o-", ms=3, label=k)
        ax.set(xlabel="step", ylabel="held-out pass@k", title="offline eval", ylim=(0, 1))
        ax.legend(fontsize=8)
        save(fig, "passk.png")
    return written


if __name__ == "__main__":
    print("\n".join(write_plots(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")))

"""PNG figures of a run, read back from `metrics.jsonl` (the figures of the reference run's report).

    reward.png      rollout reward per step, its moving average over `window` steps, and the least-squares
                    line r(t) = a + b t (slope b printed in the legend: reward gained per step)
    logprob.png     train/rollout mean |delta logp| per step (`train_rollout_logprob_abs_diff`), log scale
                    when it is positive (an exact 0, the matched-precision mode, is drawn on a linear axis)
    passk.png       eval pass@k over steps, one line per k, +- 3 standard errors over the held-out problems
                    (`pass@k_se`), and each k's chance level 1 - (1 - p)^k (dotted) when the run logged the
                    task's chance p (the demo: one digit of ten)

    python -m nanoflash.rl.plots runs/demo          # writes runs/demo/plots/*.png

`control_plot` draws the demo against its control (scripts/demo_controls.py): held-out pass@1 +- 3 standard
errors over steps, GRPO (solid) and the warm start continued with supervised steps on its own data (dashed),
per seed, with the chance line.

matplotlib is optional: without it `write_plots` prints one note and returns []. The Agg backend is used,
so no display is needed.

Tests: `pytest tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

import os
import sys

from nanoflash.rl.metrics import read_jsonl


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
    if any(k.startswith("pass@") for rec in ev for k in rec):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        passk_axes(ax, ev)
        save(fig, "passk.png")
    return written


SE_BARS = 3   # error bars of the eval figures: +- 3 standard errors over problems (as control_plot)


def passk_axes(ax, ev: list) -> None:
    """pass@k over steps on `ax`, one line per k with +- SE_BARS standard errors (`pass@k_se`, 0 if a record
    has none), and each k's chance level 1 - (1 - p)^k, dotted in the line's color, when the records carry the
    task's chance p (`chance`)."""
    ks = sorted({k for rec in ev for k in rec if k.startswith("pass@") and k[5:].isdigit()}, key=lambda k: int(k[5:]))
    chance = next((r["chance"] for r in ev if r.get("chance") is not None), None)
    for k in ks:
        pts = [r for r in ev if r.get(k) is not None]
        bars = ax.errorbar([r["step"] for r in pts], [r[k] for r in pts], capsize=2, fmt="o-", ms=3, label=k,
                           yerr=[SE_BARS * (r.get(f"{k}_se") or 0.0) for r in pts])
        if chance is not None:
            ax.axhline(1 - (1 - chance) ** int(k[5:]), ls=":", lw=1, color=bars.lines[0].get_color(),
                       label=f"chance ({k})")
    ax.set(xlabel="step", ylabel=f"held-out pass@k (+- {SE_BARS} SE)", title="offline eval", ylim=(0, 1))
    ax.legend(fontsize=7, ncol=2)


CONTROL_ARMS = (("control+20", 20), ("control+40", 40), ("control", 60))  # scripts/demo_controls.py's runs


def control_plot(res: dict, path: str, chance: float = 0.1) -> str:
    """res: {"<arm>-s<seed>": {"evals": [{"step", "pass@1", "pass@1_se"}, ...]}} -> one PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = sorted({k.rsplit("-s", 1)[1] for k in res if not k.startswith("_")}, key=int)   # "_meta": not a run
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for color, seed in zip(("tab:blue", "tab:orange", "tab:green", "tab:red"), seeds):
        g = res[f"grpo-s{seed}"]["evals"]
        ax.errorbar([e["step"] for e in g], [e["pass@1"] for e in g], yerr=[3 * e["pass@1_se"] for e in g],
                    fmt="o-", ms=4, capsize=3, color=color, label=f"GRPO, seed {seed}")
        pts = [g[0]] + [res[f"{arm}-s{seed}"]["evals"][0] for arm, _ in CONTROL_ARMS if f"{arm}-s{seed}" in res]
        xs = [0] + [n for arm, n in CONTROL_ARMS if f"{arm}-s{seed}" in res]
        ax.errorbar(xs, [e["pass@1"] for e in pts], yerr=[3 * e["pass@1_se"] for e in pts], fmt="s--", ms=4,
                    capsize=3, color=color, alpha=0.7, label=f"warm start continued (SFT), seed {seed}")
    ax.axhline(chance, ls=":", color="gray", label="chance (1 digit in 10)")
    ax.set(xlabel="steps after the warm start (GRPO steps | extra SFT steps)", ylabel="held-out pass@1 (+- 3 SE)",
           title="reward alone teaches '+1': GRPO vs the continued warm start", ylim=(0, 1))
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print("\n".join(write_plots(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")))

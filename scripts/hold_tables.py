"""Issue 42's bars for one long hold as a markdown table, rendered from the run's own metrics.

    .venv/bin/python scripts/hold_tables.py docs/results/long_hold3_h100                # print it
    .venv/bin/python scripts/hold_tables.py docs/results/long_hold3_h100 --write-docs   # into the README

A hold's result directory holds `run/metrics.jsonl` (train.py's records with LiveChecksLong's fields); the
table reads it through `instruments.runstats.summarize` (the numbers the report's summary.json holds) and
`instruments.bands.summarize`: one row per bar of issue 42 -- steps, the far share, |dlogp| against the FP8
floor overall and per position band, the excess's drift and jumps, the held-out gain against the warm start
re-evaluated, the reward's slope, the pushes -- with what was measured and whether it meets the bar, then rows
that are not bars (the C4 top-k agreement, with the rollout server's own kept sets -- SGLang's, in a hold --
where the run read them, and the step time). `--write-docs` writes it into experiments/h200/README.md between
`<!-- HOLD_TABLE:<name> -->` and `<!-- /HOLD_TABLE:<name> -->` (name: the directory's);
experiments/h200/test_hold_tables.py checks every such block against its files, so a hold's section quotes its
bars from one regenerated place. `grpo_h200.sh collect` prints it for a long run (bars.md).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from instruments import runstats  # noqa: E402
from scripts.doc_blocks import read_block, write_block  # noqa: E402,F401 (the test reads the blocks)

DOC = os.path.join(ROOT, "experiments", "h200", "README.md")
STEPS_BAR = 40          # issue 42: >= 40 GRPO steps in one hold
FAR_SHARE_BAR = 0.5     # >= 50% of the scored response tokens at positions >= 2048
BANDS = (("< 128", "window"), ("128-2047", "c4_all"), (">= 2048", "c4_topk"))


def markers(name: str) -> tuple:
    return f"<!-- HOLD_TABLE:{name} (scripts/hold_tables.py --write-docs) -->", f"<!-- /HOLD_TABLE:{name} -->"


def load(res_dir: str) -> list:
    with open(os.path.join(res_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _met(ok) -> str:
    return "" if ok is None else "yes" if ok else "**no**"


def bar_rows(recs: list) -> list:
    """(bar, measured, met: True / False / None for a row that is no bar), in the issue's order."""
    s = runstats.summarize(recs)
    train = [r for r in recs if r.get("kind") == "train"]
    b, ctx = s["bands"], s["context"]
    rows = [(f"GRPO steps >= {STEPS_BAR}", f"{s['steps']}", s["steps"] >= STEPS_BAR)]
    total = sum(b[k]["tokens"] for _, k in BANDS)
    rows.append((f"scored tokens at >= 2048: share >= {FAR_SHARE_BAR}",
                 f"{b['share_c4_topk']:.2f} ({b['c4_topk']['tokens']:,} of {total:,})",
                 b["share_c4_topk"] >= FAR_SHARE_BAR))
    rows.append((f"mean \\|dlogp\\| / FP8 floor <= {runstats.FLOOR_BAR}x, overall",
                 f"{s['gap_mean']:.4f} / {s['floor_mean']:.4f} = {s['gap_over_floor']:.2f}x",
                 s["gap_over_floor"] <= runstats.FLOOR_BAR))
    for label, k in BANDS:   # a band no scored token fell in (the CPU dry run's short prompts) has no bar to meet
        rows.append((f"... at positions {label}",
                     f"{b[k]['gap_mean']:.4f} / {b[k]['floor_mean']:.4f} = {b[k]['gap_over_floor']:.2f}x "
                     f"({b[k]['tokens']:,} tokens)", b[k]["gap_over_floor"] <= runstats.FLOOR_BAR)
                    if b[k]["tokens"] else (f"... at positions {label}", "no tokens", None))
    lo, hi = ctx["excess_drift"]["ci95"]
    rising = [label for label, k in BANDS if b[k].get("excess_increasing")]
    rows.append(("no increasing drift of the excess (gap - floor): slope's 95% CI",
                 f"[{lo:.1e}, {hi:.1e}] a step; bands increasing: {', '.join(rising) or 'none'}",
                 lo <= 0 and not rising))
    steps = [r["step"] for r in train]
    over = sorted({steps[i] for i in ctx["excess_jumps"]["over_at"]}
                  | {t for _, k in BANDS for t in b[k].get("excess_jumps", {}).get("over_steps", [])})
    rows.append(("no jump of the excess beyond 3 SE (overall or in a band)",
                 "steps " + ", ".join(map(str, over)) if over else "none", not over))
    gain = [w for w in s["warm"] if w["step"] > 0]
    if gain:
        w = gain[-1]
        rows.append((f"held-out pass@1 gain on the warm start re-evaluated >= +{runstats.GAIN_BAR}, "
                     f"> {runstats.GAIN_Z_BAR:g} SE",
                     f"{w['pass@1']:.3f} vs {w['warm_pass@1']:.3f} at step {w['step']}: "
                     f"{w['gain_pass@1']:+.3f} (SE {w['gain_se']:.3f})",
                     w["gain_pass@1"] >= runstats.GAIN_BAR and w["gain_z"] > runstats.GAIN_Z_BAR))
    else:
        rows.append((f"held-out pass@1 gain on the warm start re-evaluated >= +{runstats.GAIN_BAR}",
                     "no eval after step 0", False))
    rs = s["reward_slope"]
    rows.append(("reward slope positive (its 95% CI above 0)",
                 f"{rs['slope']:+.4f} a step, CI [{rs['ci95'][0]:+.4f}, {rs['ci95'][1]:+.4f}]", rs["ci95"][0] > 0))
    rows.append(("every push verified", f"{s['pushes_verified']} of {s['pushes']}",
                 s["pushes"] > 0 and s["pushes_verified"] == s["pushes"]))
    for key, what in (("indexer_agreement", "nanoflash's exact kept sets vs its FP8 reproduction"),
                      ("indexer_agreement_server", "nanoflash's exact kept sets vs the server's own"),
                      ("indexer_agreement_server_fp8", "the FP8 reproduction vs the server's own")):
        agree = s.get(key)
        if agree:
            layers = sorted(agree, key=lambda n: int(n.split("_")[1]))
            rows.append((f"C4 top-k overlap, {what} (layers {' / '.join(n.split('_')[1] for n in layers)})",
                         " / ".join(f"{agree[n]['overlap_mean']:.3f}" for n in layers)
                         + f" on {agree[layers[0]]['positions']:,} positions", None))
    if "indexer_agreement_server" not in s:
        rows.append(("C4 top-k overlap with the server's own kept sets", "not read in this run", None))
    t = s["time_mean_s"]
    rows.append(("a step (mean)", f"{t['step_s']:.1f} s, of which the live checks {t['live_s']:.1f} s", None))
    return rows


def table(recs: list) -> str:
    lines = ["| bar (issue 42) | measured | met |", "|---|---|---|"]
    lines += [f"| {bar} | {measured} | {_met(ok)} |" for bar, measured, ok in bar_rows(recs)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result_dir", help="a hold's directory under docs/results/ (with run/metrics.jsonl)")
    ap.add_argument("--write-docs", action="store_true", help=f"write the table into {os.path.relpath(DOC, ROOT)}")
    a = ap.parse_args()
    body = table(load(a.result_dir))
    if a.write_docs:
        write_block(DOC, markers(os.path.basename(os.path.normpath(a.result_dir))), body)
    print(body)


if __name__ == "__main__":
    main()

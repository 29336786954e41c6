"""The CPU demo against its control, two seeds: the numbers and the figure of docs/demo.md.

    .venv/bin/python scripts/demo_controls.py [--seeds 1234,1] [--out runs/controls] [--probe-only]

Per seed, one after the other (each command timed by /usr/bin/time: wall, user+sys CPU, peak RSS):
    GRPO     train.py --recipe demo          warm start (30 copy steps) + 60 GRPO steps, evals at 0/20/40/60
    control  train.py --recipe demo-control  the same warm start continued on its own copy data for 60 more
             steps (90 in all, no GRPO), evaluated at its end; and the same at +20 and +40 (warm-up 50, 70)
Then every kept checkpoint is probed on the 500 held-out problems (`metrics.answer_probe`: greedy accuracy and
the mean probability of the right answer + <eos>), so sharpening (greedy already right, probability rising) and
learning (greedy wrong before, right after) can be told apart. Writes OUT/controls.json (with the commit the
runs were made at) and docs/demo/grpo_vs_control.png (pass@1 +- 3 SE over steps, both arms, both seeds).

    .venv/bin/python scripts/demo_controls.py --write-docs OUT/controls.json

copies a controls.json to docs/demo/controls.json and rewrites the results table of docs/demo.md from it
(`demo_table`, between its DEMO_TABLE markers); tests/test_readme.py fails when docs/demo.md's table, or a
number the README quotes about the demo, differs from docs/demo/controls.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanoflash.rl import collector, trainer  # noqa: E402
from nanoflash.cli import parse_args  # noqa: E402
from nanoflash.config import run_preset  # noqa: E402
from nanoflash.rl.data import Problem  # noqa: E402
from nanoflash.rl.metrics import answer_probe, read_jsonl  # noqa: E402
from nanoflash.parallel.dcp import load_checkpoint  # noqa: E402
from nanoflash.parallel.dims import ParallelDims  # noqa: E402
from scripts.doc_blocks import read_block, write_block  # noqa: E402,F401 (tests read the table)

CONTROL_EXTRA = (20, 40)  # intermediate control points (extra SFT steps after the warm start), besides the 60
CONTROLS_JSON = os.path.join(ROOT, "docs", "demo", "controls.json")
DEMO_MD = os.path.join(ROOT, "docs", "demo.md")
DEMO_TABLE = ("<!-- DEMO_TABLE: written by scripts/demo_controls.py --write-docs from docs/demo/controls.json -->",
              "<!-- /DEMO_TABLE -->")


def timed(cmd: list, log: str) -> dict:
    """Run cmd under /usr/bin/time -v; -> {wall_s, cpu_s (user + sys), max_rss_mb}."""
    with open(log, "w") as f:
        p = subprocess.run(["/usr/bin/time", "-v"] + cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    text = open(log).read()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}); see {log}")
    get = lambda key: re.search(rf"{key}: (.*)", text).group(1).strip()  # noqa: E731
    h_m_s = [float(x) for x in get(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\)").split(":")]
    wall = sum(x * 60 ** i for i, x in enumerate(reversed(h_m_s)))
    return {"wall_s": wall, "cpu_s": float(get("User time \\(seconds\\)")) + float(get("System time \\(seconds\\)")),
            "max_rss_mb": float(get("Maximum resident set size \\(kbytes\\)")) / 1024}


def probe_run(run_dir: str, argv: list) -> dict:
    """answer_probe of every checkpoint of run_dir on the run's held-out problems: {step: probe}."""
    cfg = parse_args(argv)
    mcfg = run_preset(cfg)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    prompts = [task.encode(p) for p in task.heldout]
    refs = [task.encode(Problem("", p.prompt + p.answer, ""))[len(x):] + [task.stop_ids[0]]
            for x, p in zip(prompts, task.heldout)]
    out, root = {}, os.path.join(run_dir, "checkpoints")
    for d in sorted(os.listdir(root)):
        if d.startswith("step_") and not d.endswith(".tmp"):
            model = trainer.build_model(mcfg, ParallelDims(), cfg.parallel, torch.float32, "cpu", seed=None)
            meta = load_checkpoint(os.path.join(root, d), model, None, ParallelDims())
            out[meta["step"]] = answer_probe(model.eval(), prompts, refs, cfg.eval.temperature)
    return out


def evals(run_dir: str) -> list:
    return [{k: r.get(k) for k in ("step", "pass@1", "pass@1_se", "pass@8", "truncation_rate", "n_problems")}
            for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), "eval")]


def seeds_of(res: dict) -> list[str]:
    """The seeds of a controls.json, in the order of its GRPO runs."""
    return [k[len("grpo-s"):] for k in res if k.startswith("grpo-s")]


def demo_numbers(res: dict, seed: str) -> dict:
    """The numbers docs quote about one seed of a controls.json (pass@1 etc. as logged, not rounded)."""
    g, c = res[f"grpo-s{seed}"], res[f"control-s{seed}"]
    first, last, ctrl = g["evals"][0], g["evals"][-1], c["evals"][-1]
    return {"warm": first["pass@1"], "warm_se": first["pass@1_se"], "grpo": last["pass@1"],
            "grpo_se": last["pass@1_se"], "control": ctrl["pass@1"], "control_se": ctrl["pass@1_se"],
            "mid": [e["pass@1"] for e in g["evals"][1:-1]], "mid_steps": [e["step"] for e in g["evals"][1:-1]],
            "steps": last["step"], "pass8": last["pass@8"], "n_problems": first.get("n_problems"),
            "cpu_s": g["time"]["cpu_s"], "wall_s": g["time"]["wall_s"], "control_cpu_s": c["time"]["cpu_s"],
            "control_wall_s": c["time"]["wall_s"],
            "control_mid": [res[f"{a}-s{seed}"]["evals"][-1]["pass@1"] for a in
                            [f"control+{n}" for n in CONTROL_EXTRA] if f"{a}-s{seed}" in res],
            "greedy": (g["probe"][str(first["step"])]["greedy_accuracy"], g["probe"][str(last["step"])]["greedy_accuracy"]),
            "p_right": (g["probe"][str(first["step"])]["p_right_mean"], g["probe"][str(last["step"])]["p_right_mean"]),
            "control_greedy": c["probe"][str(ctrl["step"])]["greedy_accuracy"],
            "control_p_right": c["probe"][str(ctrl["step"])]["p_right_mean"],
            "truncation": (first["truncation_rate"], last["truncation_rate"])}


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def demo_table(res: dict) -> str:
    """docs/demo.md's results table, every cell from a controls.json."""
    seeds = seeds_of(res)
    d = {s: demo_numbers(res, s) for s in seeds}
    steps = d[seeds[0]]["steps"]
    mid = " / ".join(str(x) for x in d[seeds[0]]["mid_steps"] + [steps])
    extra = " / ".join(f"+{n}" for n in list(CONTROL_EXTRA) + [steps])
    f3 = lambda x: f"{x:.3f}"  # noqa: E731
    rows = [
        (f"held-out ({d[seeds[0]]['n_problems']} problems)", lambda n: f"seed {n}"),
        ("warm start (step 0): pass@1 +- SE", lambda n: f"{f3(d[n]['warm'])} +- {f3(d[n]['warm_se'])}"),
        ("warm start: greedy accuracy / mean p(right answer)",
         lambda n: f"{f3(d[n]['greedy'][0])} / {f3(d[n]['p_right'][0])}"),
        (f"**GRPO**, pass@1 at steps {mid}",
         lambda n: " / ".join(f3(x) for x in d[n]["mid"]) + f" / **{f3(d[n]['grpo'])} +- {f3(d[n]['grpo_se'])}**"),
        (f"GRPO step {steps}: greedy accuracy / mean p(right answer)",
         lambda n: f"{f3(d[n]['greedy'][1])} / {f3(d[n]['p_right'][1])}"),
        (f"GRPO step {steps}: pass@8", lambda n: f3(d[n]["pass8"])),
        (f"**control** (warm start continued), pass@1 at {extra}",
         lambda n: " / ".join(f3(x) for x in d[n]["control_mid"])
         + f" / **{f3(d[n]['control'])} +- {f3(d[n]['control_se'])}**"),
        (f"control +{steps}: greedy accuracy / mean p(right answer)",
         lambda n: f"{f3(d[n]['control_greedy'])} / {f3(d[n]['control_p_right'])}"),
        (f"**GRPO minus control at {steps} steps** (pass@1; SE of the difference)",
         lambda n: f"**{100 * (d[n]['grpo'] - d[n]['control']):+.1f} points** "
                   f"({100 * (d[n]['grpo_se'] ** 2 + d[n]['control_se'] ** 2) ** 0.5:.1f})"),
        (f"eval truncation rate, step 0 -> {steps}",
         lambda n: f"{f3(d[n]['truncation'][0])} -> {f3(d[n]['truncation'][1])}"),
        ("GRPO run (`--recipe demo`): CPU time user+sys / wall",
         lambda n: f"{d[n]['cpu_s']:.0f} s / {_minutes(d[n]['wall_s'])}"),
        ("control run (`--recipe demo-control`): CPU time / wall",
         lambda n: f"{d[n]['control_cpu_s']:.0f} s / {_minutes(d[n]['control_wall_s'])}"),
    ]
    lines = []
    for i, (head, cell) in enumerate(rows):
        lines.append("| " + " | ".join([head] + [cell(n) for n in seeds]) + " |")
        if i == 0:
            lines.append("|" + "---|" * (1 + len(seeds)))
    when = f"runs at commit {res.get('_meta', {}).get('runs_commit', '?')[:7]}"
    return "\n".join(lines + ["", f"Every cell: `docs/demo/controls.json` ({when})."])


def write_docs(src: str) -> None:
    """src (a controls.json) -> docs/demo/controls.json and docs/demo.md's table."""
    with open(src) as f:
        res = json.load(f)
    if os.path.abspath(src) != CONTROLS_JSON:
        with open(CONTROLS_JSON, "w") as f:
            json.dump(res, f, indent=1)
    write_block(DEMO_MD, DEMO_TABLE, demo_table(res))
    print(f"wrote {CONTROLS_JSON} and the table of {DEMO_MD}")


def git_commit() -> str:
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return p.stdout.strip() + ("+dirty" if dirty else "") if p.returncode == 0 else "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1234,1")
    ap.add_argument("--out", default="runs/controls")
    ap.add_argument("--arms", default="", help="run only these arms, e.g. control,control+20 (default: all)")
    ap.add_argument("--probe-only", action="store_true", help="the runs (and their .time.json) exist: probe, plot")
    ap.add_argument("--write-docs", metavar="CONTROLS_JSON", help="only rewrite docs/demo/controls.json and "
                    "docs/demo.md's table from this file")
    args = ap.parse_args()
    if args.write_docs:
        return write_docs(args.write_docs)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    commit_file = os.path.join(args.out, "COMMIT")   # the code the runs were made with (kept by --probe-only)
    if not args.probe_only:
        with open(commit_file, "w") as f:
            f.write(git_commit() + "\n")
    res = {"_meta": {"runs_commit": open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown",
                     "probe_commit": git_commit()}}
    for seed in [int(s) for s in args.seeds.split(",")]:
        arms = {"grpo": ["--recipe", "demo"], "control": ["--recipe", "demo-control"]}
        arms.update({f"control+{n}": ["--recipe", "demo-control", "--train.warmup_steps", str(30 + n)]
                     for n in CONTROL_EXTRA})
        for arm, argv in arms.items():
            run = os.path.join(args.out, f"{arm}-s{seed}")
            argv = argv + ["--seed", str(seed), "--out", run, "--train.progress", "false"]
            entry = {"argv": argv}
            if args.arms and arm not in args.arms.split(","):
                continue
            if not args.probe_only:
                with open(run + ".time.json", "w") as f:
                    json.dump(timed([sys.executable, "train.py"] + argv, run + ".log"), f)
            with open(run + ".time.json") as f:
                entry["time"] = json.load(f)
            print(f"{run}: {entry['time']}", flush=True)
            entry["evals"], entry["probe"] = evals(run), probe_run(run, argv)
            res[f"{arm}-s{seed}"] = entry
    with open(os.path.join(args.out, "controls.json"), "w") as f:
        json.dump(res, f, indent=1)
    from nanoflash.rl.plots import control_plot
    print(control_plot(res, os.path.join(ROOT, "docs", "demo", "grpo_vs_control.png")))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""The CPU demo against its control, two seeds: the numbers and the figure of docs/demo.md.

    .venv/bin/python scripts/demo_controls.py [--seeds 1234,1] [--out runs/controls] [--probe-only]

Per seed, one after the other (each command timed by /usr/bin/time: wall, user+sys CPU, peak RSS):
    GRPO     train.py --recipe demo          warm start (30 copy steps) + 60 GRPO steps, evals at 0/20/40/60
    control  train.py --recipe demo-control  the same warm start continued on its own copy data for 60 more
             steps (90 in all, no GRPO), evaluated at its end; and the same at +20 and +40 (warm-up 50, 70)
Then every kept checkpoint is probed on the 500 held-out problems (`metrics.answer_probe`: greedy accuracy and
the mean probability of the right answer + <eos>), so sharpening (greedy already right, probability rising) and
learning (greedy wrong before, right after) can be told apart. Writes OUT/controls.json and
docs/demo/grpo_vs_control.png (pass@1 +- 3 SE over steps, both arms, both seeds).
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

CONTROL_EXTRA = (20, 40)  # intermediate control points (extra SFT steps after the warm start), besides the 60


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
    return [{k: r.get(k) for k in ("step", "pass@1", "pass@1_se", "pass@8", "truncation_rate")}
            for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"), "eval")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1234,1")
    ap.add_argument("--out", default="runs/controls")
    ap.add_argument("--arms", default="", help="run only these arms, e.g. control,control+20 (default: all)")
    ap.add_argument("--probe-only", action="store_true", help="the runs (and their .time.json) exist: probe, plot")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {}
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

"""The suite's size (and, with --run, its time): docs/results/suite.json, which README's numbers quote.

    .venv/bin/python scripts/suite_stats.py          # count: `pytest --collect-only` of the default selection
    .venv/bin/python scripts/suite_stats.py --run    # also run it (`pytest -q -n auto --dist loadscope`, as CI) and time it

Writes {"commit", "selected", "deselected", and with --run "passed", "failed", "wall_s"}; a field it did not
measure this time is dropped, never carried over from an older file. tests/test_readme.py fails when the README
quotes another count (or time) than this file.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "results", "suite.json")


def git_commit() -> str:
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return p.stdout.strip() + ("+dirty" if dirty else "") if p.returncode == 0 else "unknown"


def count(text: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", text)
    return int(m.group(1)) if m else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="run the suite too (minutes), and time it")
    args = ap.parse_args()
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT, capture_output=True,
                       text=True)
    last = p.stdout.strip().splitlines()[-1]                  # "649/687 tests collected (38 deselected) in 8.36s"
    m = re.match(r"(\d+)(?:/(\d+))? tests? collected", last)
    if p.returncode != 0 or not m:
        raise SystemExit(f"pytest --collect-only failed: {last}\n{p.stderr[-2000:]}")
    res = {"commit": git_commit(), "selected": int(m.group(1)), "deselected": count(last, "deselected")}
    if args.run:
        t0 = time.time()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "auto", "--dist", "loadscope"], cwd=ROOT, capture_output=True, text=True)
        tail = run.stdout.strip().splitlines()[-1]
        res.update(wall_s=round(time.time() - t0, 1), passed=count(tail, "passed"), failed=count(tail, "failed"))
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {res}")


if __name__ == "__main__":
    main()

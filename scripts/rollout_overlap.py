"""Sync vs one-step-off on the CPU, the embedded rollout server in its own process (issue 41 item 5).

    .venv/bin/python scripts/rollout_overlap.py                      # both runs -> docs/results/rollout_overlap_cpu.json
    .venv/bin/python scripts/rollout_overlap.py --write-docs docs/results/rollout_overlap_cpu.json   # docs table only

What it runs: the CPU demo (`--recipe demo`: the copy warm start, then GRPO on "the last digit of a + 1") for
`--steps` steps twice, synchronous and `--rollout.async true`, both with TIS (`--grpo.use_tis true`: the
asynchronous run needs it, so the synchronous one has it too) and adaptive over-sampling (each round sized
from the keep rate seen; the demo recipe's fixed 16-prompt rounds send 16 prompts for one missing group),
the same seed, against ONE embedded server
started as its own process (`python -m nanoflash.server`, one thread, FP8 weights, from a checkpoint of the
demo's model written here) that each run pushes its weights into (`--rollout.urls`). The trainer has one
thread, the server one: on a 2-core machine rollouts and training can overlap, as rollout and training nodes
do. Evals every `--eval-every` steps through the server.

What it writes (`docs/results/rollout_overlap_cpu.json`): per run the mean step time over steps 2..N (step 1
pays for compiles and the first rollout), the mean rollout / train / push / wait times, the held-out pass@1
(with its SE) at every eval, the samples generated per sample trained over the run (the tail abort's bar:
<= 1.5), staleness, and the TIS ratio; the step-time ratio async / sync; the commit and the command.
`--write-docs` renders the table of docs/rollouts.md from such a file (tests/test_rollout_docs.py checks it).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanoflash.checkpoint import save_hf_checkpoint  # noqa: E402
from nanoflash.cli import parse_args  # noqa: E402
from nanoflash.config import preset  # noqa: E402
from nanoflash.model import Transformer  # noqa: E402
from nanoflash.rl.metrics import read_jsonl  # noqa: E402
from scripts.doc_blocks import read_block, write_block  # noqa: E402,F401 (tests read the table)

RESULTS = os.path.join(ROOT, "docs", "results", "rollout_overlap_cpu.json")
DOC = os.path.join(ROOT, "docs", "rollouts.md")
TABLE = ("<!-- ROLLOUT_OVERLAP_TABLE: scripts/rollout_overlap.py --write-docs -->", "<!-- /ROLLOUT_OVERLAP_TABLE -->")
FIRST_TIMED_STEP = 2   # step 1 pays for the first rollout's start (and, one step off, runs alone)
MODES = {"sync": [], "async": ["--rollout.async", "true"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: str, port: int, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanoflash.server", "--checkpoint", ckpt, "--weights", "fp8", "--port", str(port),
           "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        time.sleep(0.2)
    raise SystemExit(f"the server did not listen on {port} within 120 s; see {log}")


def run_args(a, mode: str, out: str, url: str) -> list:
    return ["--recipe", "demo", "--steps", str(a.steps), "--out", out, "--rollout.urls", url, "--grpo.use_tis", "true",
            "--grpo.adaptive_over_sampling", "true",
            "--eval.every", str(a.eval_every), "--eval.n_problems", str(a.eval_problems), "--eval.k_samples",
            str(a.eval_k), "--train.progress", "false", "--train.plots", "false", "--train.save_every", "-1",
            *MODES[mode]]


def summary(run_dir: str) -> dict:
    """One run's numbers from its metrics.jsonl."""
    recs = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in recs if r["kind"] == "train"]
    timed = [r for r in train if r["step"] >= FIRST_TIMED_STEP]
    mean = lambda k: sum(r.get(k) or 0.0 for r in timed) / len(timed)  # noqa: E731
    gen, trained = sum(r["samples_generated"] for r in train), sum(r["samples_trained"] for r in train)
    return {"steps": len(train), "step_s": mean("step_s"), "rollout_s": mean("rollout_s"),
            "rollout_wait_s": mean("rollout_wait_s"), "train_s": mean("train_s"), "sync_s": mean("sync_s"),
            "boundary_wait_s": mean("boundary_wait_s"), "samples_generated": gen, "samples_trained": trained,
            "generated_per_trained": gen / trained, "staleness_max": max(r.get("staleness_max", 0) for r in train),
            "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in train) / len(train),
            "tis_mean": sum(r.get("tis", 1.0) for r in train) / len(train),
            "logprob_abs_diff_mean": sum(r.get("train_rollout_logprob_abs_diff", 0.0) for r in train) / len(train),
            "pushes": sum("sync_s" in r for r in train), "reward_mean": [round(r["reward_mean"], 4) for r in train],
            "evals": [{"step": r["step"], "pass@1": r["pass@1"], "se": r["pass@1_se"]}
                      for r in recs if r["kind"] == "eval"]}


def git_commit() -> str:
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return p.stdout.strip() + ("+dirty" if dirty else "") if p.returncode == 0 else "unknown"


def measure(a) -> dict:
    cfg = parse_args(["--recipe", "demo"])
    ckpt = os.path.join(a.out, "init")
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    torch.manual_seed(cfg.train.seed)
    save_hf_checkpoint(Transformer(preset("tiny", **cfg.model)).init_weights(cfg.train.seed), ckpt, weights="fp8",
                       experts="fp8")   # what the push sends: the preflight refuses a server holding other experts
    port = a.port or free_port()
    url, res = f"http://127.0.0.1:{port}", {}
    server = start_server(ckpt, port, os.path.join(a.out, "server.log"))
    try:
        for mode in MODES:
            out = os.path.join(a.out, mode)
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), *run_args(a, mode, out, url)]
            t0, load0 = time.time(), os.getloadavg()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            with open(os.path.join(a.out, f"{mode}.log"), "w") as f:
                f.write(p.stdout + p.stderr)
            if p.returncode:
                raise SystemExit(f"{mode} run failed ({p.returncode}); see {a.out}/{mode}.log")
            res[mode] = {"wall_s": time.time() - t0, "loadavg_1min": [load0[0], os.getloadavg()[0]], **summary(out)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
    res["async_over_sync_step_s"] = res["async"]["step_s"] / res["sync"]["step_s"]
    res["_meta"] = {"commit": git_commit(), "command": "scripts/rollout_overlap.py " + " ".join(sys.argv[1:]),
                    "steps": a.steps, "cpus": os.cpu_count(), "train_args": run_args(a, "async", "OUT", "URL")}
    return res


def f3(x: float) -> str:
    return f"{x:.3f}"


def table(res: dict) -> str:
    """docs/rollouts.md's table, from a rollout_overlap_cpu.json."""
    s, a = res["sync"], res["async"]
    last = lambda r: r["evals"][-1]  # noqa: E731
    rows = [("step time, mean of steps 2..N (s)", f"{s['step_s']:.2f}", f"{a['step_s']:.2f}"),
            ("rollout, its own time (s)", f"{s['rollout_s']:.2f}", f"{a['rollout_s']:.2f}"),
            ("trainer waiting for a rollout (s)", f"{s['rollout_wait_s'] + s['boundary_wait_s']:.2f}",
             f"{a['rollout_wait_s'] + a['boundary_wait_s']:.2f}"),
            ("train (old log-probs + step) (s)", f"{s['train_s']:.2f}", f"{a['train_s']:.2f}"),
            ("push (s)", f"{s['sync_s']:.2f}", f"{a['sync_s']:.2f}"),
            (f"held-out pass@1 at step {last(s)['step']} (SE)", f"{f3(last(s)['pass@1'])} ({f3(last(s)['se'])})",
             f"{f3(last(a)['pass@1'])} ({f3(last(a)['se'])})"),
            ("samples generated / trained", f"{s['generated_per_trained']:.2f}", f"{a['generated_per_trained']:.2f}"),
            ("staleness, mean / max (steps)", f"{s['staleness_mean']:.2f} / {s['staleness_max']}",
             f"{a['staleness_mean']:.2f} / {a['staleness_max']}"),
            ("TIS ratio exp(old - rollout), mean", f3(s["tis_mean"]), f3(a["tis_mean"])),
            ("pushes, each verified", str(s["pushes"]), str(a["pushes"])),
            ("machine load (1-min average) at start / end", *(" / ".join(f"{x:.1f}" for x in r["loadavg_1min"])
                                                             for r in (s, a)))]
    curve = " / ".join(f"{e['step']}: {f3(e['pass@1'])} vs {f3(b['pass@1'])}" for e, b in zip(s["evals"], a["evals"]))
    lines = ["| measured | synchronous | one step off |", "|---|---|---|"]
    lines += [f"| {k} | {x} | {y} |" for k, x, y in rows]
    lines += ["", f"Async / sync step time: **{res['async_over_sync_step_s']:.2f}**. Held-out pass@1 by step (sync vs "
              f"async): {curve}. {res['_meta']['steps']} steps each, commit `{res['_meta']['commit'][:12]}`."]
    return "\n".join(lines)


def write_docs(src: str) -> None:
    with open(src) as f:
        res = json.load(f)
    if os.path.abspath(src) != RESULTS:
        with open(RESULTS, "w") as f:
            json.dump(res, f, indent=1)
    write_block(DOC, TABLE, table(res))
    print(f"wrote {RESULTS} and the table of {DOC}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--out", default="runs/rollout_overlap")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    ap.add_argument("--write-docs", metavar="JSON", help="only render docs/rollouts.md's table from this file")
    a = ap.parse_args()
    if a.write_docs:
        return write_docs(a.write_docs)
    res = measure(a)
    with open(RESULTS, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "_meta"}, indent=1)[:3000])
    if os.path.exists(DOC):
        write_docs(RESULTS)


if __name__ == "__main__":
    main()

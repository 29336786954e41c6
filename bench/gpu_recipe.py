"""The `gpu` recipe on one GPU, measured: per-step time split, train tokens/s, GPU and host memory peaks, each
next to the planner's prediction for the same config (`planner.plan` with `setup_from_run`).

    PYTHONPATH=. python bench/gpu_recipe.py --out /tmp/gpu_recipe [more train.py overrides]

1. baseline: the resident memory of a process that imported nanoflash and created a CUDA context (the
   planner's HOST_PROCESS_BYTES assumption, measured);
2. the run: `python train.py --recipe gpu` as a child; its peak RSS from getrusage(RUSAGE_CHILDREN) and a VmRSS
   timeline (1 s samples beside the last stdout line: which phase holds the host peak), its GPU
   peak (`torch.cuda.max_memory_allocated`, logged by train.py), metrics.jsonl for the time split:
   rollout | old log-probs | train (incl. the optimizer step, also shown alone) | push | eval;
3. the prediction: the activation fit of the preset measured on this GPU (`measure_layer_bytes`), sequences
   of the task's prompt length + max_new_tokens, every planner term of rank 0.
Prints one JSON document (also written to OUT/gpu_recipe.json).
"""
import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import torch

GIB = 2 ** 30
BASELINE = ("import resource, torch, nanoflash.model, nanoflash.rl.collector; torch.zeros(1, device='cuda'); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def rss_gib(pid: int) -> float:
    """Resident memory of process `pid` now (VmRSS), GiB; 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 2 ** 20
    except (OSError, StopIteration):
        return 0.0


def _thin(timeline: list) -> list:
    """Every 5th sample and the first at the peak, as "t s: rss GiB | last stdout line" strings."""
    top = max((x[1] for x in timeline), default=0.0)
    first_top = next((i for i, x in enumerate(timeline) if x[1] >= top), -1)
    return [f"{t} s: {r} GiB | {ln}" for i, (t, r, ln) in enumerate(timeline) if i % 5 == 0 or i == first_top]


def run(out: str, extra: list, timeout: float) -> dict:
    """train.py --recipe gpu as a child (killed after `timeout` s: the steps it logged are still read). Its
    resident memory is sampled every second next to the stdout line it had printed by then ("actor: ..." after
    the build, "step N" after each step), so a host peak can be placed in a phase."""
    t0 = time.time()
    cmd = [sys.executable, "train.py", "--recipe", "gpu", "--out", os.path.join(out, "run"),
           "--train.progress", "false", "--train.plots", "false", *extra]
    paths = [os.path.join(out, f"train.{k}") for k in ("stdout", "stderr")]
    with open(paths[0], "w") as fo, open(paths[1], "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True)
        timeline = []
        while proc.poll() is None and time.time() - t0 < timeout:
            lines = [ln for ln in open(paths[0]).read().splitlines() if ln.strip()]
            timeline.append((round(time.time() - t0, 1), round(rss_gib(proc.pid), 2), lines[-1][:40] if lines else ""))
            time.sleep(1.0)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    rc = "timeout" if proc.returncode < 0 and time.time() - t0 >= timeout else proc.returncode
    stdout, stderr = (open(p_).read() for p_ in paths)
    res = {"rc": rc, "wall_s": time.time() - t0, "stdout_tail": stdout[-1500:],
           "stderr_tail": stderr[-2500:] if rc != 0 else "",
           "host_peak_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB,
           "rss_timeline": _thin(timeline)}
    path = os.path.join(out, "run", "metrics.jsonl")
    recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    evals = {r["step"]: r for r in recs if r["kind"] == "eval"}
    steps = []
    for r in (r for r in recs if r["kind"] == "train"):
        lp = r.get("logprobs_s", 0.0)
        steps.append({"step": r["step"], "rollout_s": r.get("rollout_s"), "logprobs_s": lp,
                      "train_s": r.get("train_s", lp) - lp, "optim_s": r.get("optim_s"), "push_s": r.get("sync_s"),
                      "eval_s": evals.get(r["step"], {}).get("eval_s", 0.0), "step_s": r.get("step_s"),
                      "train_tokens_per_s": r.get("train_tokens_per_s"), "gpu_peak_gib": r.get("gpu_peak_gib"),
                      "reward_mean": r.get("reward_mean"), "abs_dlogp": r.get("train_rollout_logprob_abs_diff")})
    res["steps"] = steps
    res["startup"] = next((r for r in recs if r["kind"] == "startup"), None)  # train.py's start-up phases
    res["eval"] = {k: v for r in evals.values() for k, v in r.items() if k.startswith(("pass@", "truncation"))}
    return res


def predicted(extra: list) -> dict:
    from nanoflash.rl import collector
    from nanoflash.cli import parse_args
    from nanoflash.config import run_preset
    from nanoflash.parallel import planner
    cfg = parse_args(["--recipe", "gpu", *extra])
    mcfg = run_preset(cfg)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    seq = len(task.encode(task.train[0])) + cfg.rollout.max_new_tokens - 1
    fit = planner.measure_layer_bytes(mcfg, (256, 512), device="cuda" if torch.cuda.is_available() else "cpu")
    setup = dataclasses.replace(planner.setup_from_run(cfg, mcfg, world=1), seq_len=seq)
    row = planner.plan(mcfg, cfg.parallel, fit, dtype=torch.bfloat16, setup=setup)[0]
    g = {k: v / GIB for k, v in row["gpu_terms"].items()}
    h = {k: v / GIB for k, v in row["host_terms"].items()}
    return {"seq_len": seq, "gpu_terms_gib": g, "gpu_gib": row["gpu_bytes"] / GIB, "host_terms_gib": h,
            "host_gib": row["host_bytes"] / GIB, "cuda_context_gib": planner.CUDA_CONTEXT_BYTES / GIB}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu_recipe")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds the run may take")
    a, extra = ap.parse_known_args()
    os.makedirs(a.out, exist_ok=True)
    base = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True)
    doc = {"process_baseline_gib": int(base.stdout.strip().splitlines()[-1]) / GIB if base.returncode == 0 else None}
    doc["run"] = run(a.out, extra, a.timeout)
    doc["planner"] = predicted(extra)
    text = json.dumps(doc, indent=1, default=lambda v: round(v, 4) if isinstance(v, float) else str(v))
    open(os.path.join(a.out, "gpu_recipe.json"), "w").write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()

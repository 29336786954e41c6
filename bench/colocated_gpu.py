"""Four ranks of the engine on one GPU (issue 37 item 1): PP2 x EP2 GRPO steps checked against one process.

    python bench/colocated_gpu.py --out docs/results/colocated_pp2ep2_h200.json   # one H200, ~5.5 min
    python bench/colocated_gpu.py --device cpu --out /tmp/colocated_cpu.json      # the same on the CPU, tiny
    python bench/colocated_gpu.py --write-docs docs/results/colocated_pp2ep2_h200.json   # docs/benchmarks.md's table

One command, four phases:

1. the start: a seeded model written as an HF checkpoint (`small` with 4 layers on the GPU -- Flash's layer
   kinds: hash, C4 and C128 layers, 16 experts top-6, MTP --; `tiny` on the CPU), so both runs load the very same
   weights and nothing is saved at step 0;
2. the run: `torchrun --nproc-per-node 4 train.py --parallel.pp 2 --parallel.ep 2 --parallel.colocate_ranks true`
   -- every rank on cuda:0, gloo with CUDA tensors, P2P through pinned host buffers --, bf16, `kernels=auto`,
   recompute, routing replay, AdamW offloaded, N GRPO steps with the embedded server on the same GPU and
   per-stage pushes over gloo update groups, a checkpoint at the end. A hook (`ReplayRecorder`) keeps each
   step's global batch and old log-probs; a reward plug-in (`varied_reward`) gives every group different
   rewards, so every step has non-zero advantages (an untrained model scores 0 on the arithmetic task);
3. the reference: one process replays the same batches through the same `Trainer.step` from the same start
   (rollouts are the run's own: a free-running single process would sample other tokens as soon as one bf16
   weight differs), and a control replays them once more with half the micro-batch budget;
4. the comparison and the memory, written as one JSON document (`--out`); exit 1 if a bound fails.

The bounds (bf16; `compare`):
* weights: |w_run - w_ref| <= one bf16 ulp of max(|w_run|, |w_ref|) + 2 lr sum_t a_t, elementwise. Each AdamW
  step moves a master by at most lr a_t (a_t = `adam_step_bound`, ~1.0 for t <= 3 with betas (0.9, 0.98)),
  whatever the gradients, so two runs from one start differ by at most twice the sum; rounding the masters to
  bf16 adds at most one ulp. Sound, but any run passes it whose gradients are finite: a necessary check;
* first moments: m = (1 - b1) sum_t b1^(N-t) g_t is linear in the gradients, so ||m_run - m_ref|| / ||m_ref||
  is the relative error of the step's gradients. A correct engine differs from one process only in bf16
  summation order (micro-batch and data-shard splits, the bf16 all-reduce of dense gradients); a broken one
  (a gradient not reduced, an activation not delivered, a wrong expert) differs at O(1). The bound is
  `MOMENT_FACTOR` x the control's difference -- the same process re-split into other micro-batches, the size
  of bf16 reordering in this very computation -- plus `MOMENT_FLOOR`;
* old log-probs: the run's forward against the reference's on every response token (reported).

Memory: each rank's own allocator peak (`torch.cuda.max_memory_allocated`, train.py's `memory` record) next to
the planner's GPU bytes for that rank (`planner.plan` with `setup_from_run`, the activation fit measured on this
device); the GPU's total in use (nvidia-smi, sampled) next to the planner's sum plus a CUDA context per rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanoflash.rl.hooks import Hook  # noqa: E402
from scripts.doc_blocks import read_block, write_block  # noqa: E402,F401 (its test reads the table)

GIB = 2 ** 30
# The first moments of the run may differ from one process by this many times what re-splitting the same
# process into other micro-batches changes (bf16 reordering measured in this very computation): the run adds
# a few rounding points of its own (the bf16 all-reduce of dense gradients over EP, the data-shard split,
# pipeline micro-batches). On the CPU (tiny, docs/results/colocated_pp2ep2_cpu.json, written by `--device cpu
# --out` that path) the run's difference and the control's are of one size.
MOMENT_FACTOR = 4.0
MOMENT_FLOOR = 1e-3  # relative: below it any two bf16 runs agree (a control that happens to change nothing)
LR = 1e-6            # the V4 recipe's: the weights stay within a few bf16 ulps, so the steps see nearly one model
FP32_EPS = 2.0 ** -23  # fp32 ulp of 1
BF16_MANTISSA = 7    # explicit mantissa bits: one ulp of |w| in [2^e, 2^(e+1)) is 2^(e-7)
MODES = {   # the start model and the run's sizes per device
    "cuda": dict(preset="small", model=dict(n_layers=4, compress_ratios=(0, 4, 128, 4, 0), vocab_size=18,
                                          max_seq_len=32),
                 flags=["--train.dtype", "bf16", "--parallel.offload_optimizer", "true", "--grpo.n_prompts", "4",
                        "--grpo.group_size", "8", "--rollout.max_new_tokens", "8", "--parallel.micro_batch_tokens",
                        "64", "--rollout.weights", "fp8"], fit_lens=(256, 512)),
    "cpu": dict(preset="tiny", model=dict(vocab_size=18, max_seq_len=32),
                flags=["--train.dtype", "bf16", "--parallel.offload_optimizer", "true", "--grpo.n_prompts", "4",
                       "--grpo.group_size", "8", "--rollout.max_new_tokens", "4", "--parallel.micro_batch_tokens",
                       "48", "--rollout.weights", "fp8", "--train.threads", "1"], fit_lens=(64, 128)),
}


# ---------------------------------------------------------------------------------------------- run-side pieces
def varied_reward(response: str, problem) -> float:
    """A reward plug-in that varies inside every group (the parity of the response's characters), so the GRPO
    advantages are non-zero whatever the model answers. It is data for the comparison, not a task."""
    return float(sum(map(ord, response)) % 2)


class ReplayRecorder(Hook):
    """Rank 0: each step's global batch (its tensors) and the run's old log-probs, before the update, to
    <out_dir>/replay/step_<N>.pt -- what the reference replays."""

    name = "replay"

    def before_update(self, batch, old, step: int) -> dict:
        d = os.path.join(self.ctx.cfg.train.out_dir, "replay")
        os.makedirs(d, exist_ok=True)
        torch.save({"batch": {k: v for k, v in vars(batch).items() if torch.is_tensor(v)}, "old": old},
                   os.path.join(d, f"step_{step}.pt"))
        return {}


# ---------------------------------------------------------------------------------------------- phases
def write_start(path: str, mode: dict, seed: int) -> None:
    from nanoflash.checkpoint import save_hf_checkpoint
    from nanoflash.config import preset
    from nanoflash.model import Transformer
    save_hf_checkpoint(Transformer(preset(mode["preset"], **mode["model"])).init_weights(seed), path)


def run_args(mode: dict, start: str, out: str, steps: int, sync_port: int) -> list:
    """train.py's arguments of the run, layout flags excluded (the reference reads the same)."""
    return ["--recipe", "smoke", "--train.checkpoint", start, "--out", out, "--train.steps", str(steps),
            "--train.warmup_steps", "0", "--train.save_every", "0", "--train.progress", "false",
            "--train.plots", "false", "--eval.every", "0", "--optim.lr", str(LR), "--grpo.dynamic_sampling", "false",
            "--train.reward", "bench.colocated_gpu:varied_reward", "--rollout.routing_replay", "true",
            "--parallel.recompute", "true", "--rollout.transport", "distributed",
            "--rollout.sync_addr", f"127.0.0.1:{sync_port}", *mode["flags"]]


class GpuSampler:
    """nvidia-smi's memory in use on the GPU, sampled every 0.5 s while the run lasts (peak, MiB)."""

    def __init__(self, on: bool):
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True) if on and shutil.which("nvidia-smi") else None
        if self.thread:
            self.thread.start()

    def _loop(self):
        while not self.stop.wait(0.5):
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                               capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip():
                self.peak = max(self.peak, int(r.stdout.split()[0]))

    def close(self) -> int | None:
        self.stop.set()
        return self.peak if self.thread else None


def run_colocated(args_: list, out: str, timeout: float, gpu: bool) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                str(free_port())]
    cmd = torchrun + [os.path.join(ROOT, "train.py"), *args_, "--parallel.pp", "2", "--parallel.ep", "2",
                      "--parallel.colocate_ranks", "true", "--train.hooks", "bench.colocated_gpu:ReplayRecorder"]
    t0, sampler = time.time(), GpuSampler(gpu)
    with open(os.path.join(out, "run.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    peak = sampler.close()
    text = open(os.path.join(out, "run.log")).read()
    return {"command": " ".join(cmd[1:]), "rc": rc, "wall_s": round(time.time() - t0, 1),
            "nvidia_smi_peak_gib": peak / 1024 if peak else None,
            "log_tail": "\n".join(x for x in text.splitlines() if not x.startswith(("W1", "[W")))[-3000:]}


def say(t0: float, what: str) -> None:
    """A progress line (stderr, flushed): a run that stops early shows which phase it reached."""
    print(f"[{time.time() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single(args_: list, micro_batch_tokens: str | None = None):
    """A world-1 Trainer of the run's config (the layout flags left out), loaded from the start, optimizer on."""
    from nanoflash.cli import model_config, parse_args
    from nanoflash.parallel.dims import ParallelDims
    from nanoflash.rl.trainer import Trainer
    from nanoflash.sglang.buckets import optimizer_storage
    argv = args_ + (["--parallel.micro_batch_tokens", micro_batch_tokens] if micro_batch_tokens else [])
    cfg = parse_args(argv)
    mcfg = model_config(cfg)
    if cfg.train.threads:   # as train.py
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    t = Trainer(cfg, mcfg, ParallelDims(), cfg.train.checkpoint, False, served_storage=optimizer_storage(cfg, mcfg))
    t.start_optimizer()
    return t


def replay(args_: list, replay_dir: str, steps: int, micro_batch_tokens: str | None = None) -> dict:
    """The run's batches through one process's `Trainer.step`; -> its final state and old log-probs."""
    from nanoflash.grpo import RolloutBatch
    t = single(args_, micro_batch_tokens)
    olds = {}
    for k in range(1, steps + 1):
        rec = torch.load(os.path.join(replay_dir, f"step_{k}.pt"), weights_only=True)
        batch = RolloutBatch(**rec["batch"])
        t.step(batch, k, before_update=lambda b, old, k=k: olds.__setitem__(k, old.clone()) or {})
    return {"model": _cpu(t.model.state_dict()), "optim": _cpu(t.optimizer.state_dict()), "old": olds}


def run_state(args_: list, ckpt: str) -> dict:
    """The run's final checkpoint (any layout) loaded into a world-1 model and optimizer."""
    from nanoflash.parallel.dcp import load_checkpoint
    from nanoflash.parallel.dims import ParallelDims
    t = single(args_)
    meta = load_checkpoint(ckpt, t.model, t.optimizer, ParallelDims())
    return {"model": _cpu(t.model.state_dict()), "optim": _cpu(t.optimizer.state_dict()), "step": meta["step"]}


def _cpu(sd: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------- the bounds
def adam_step_bound(t: int, b1: float, b2: float) -> float:
    """max |m_hat_t| / sqrt(v_hat_t) over all gradient sequences (eps = 0): by Cauchy-Schwarz,
    (1-b1)/(1-b1^t) sqrt(sum_{j<t} (b1^2/b2)^j) sqrt((1-b2^t)/(1-b2)) -- 1.002 at t = 3 for (0.9, 0.98)."""
    r = sum((b1 * b1 / b2) ** j for j in range(t))
    return (1 - b1) / (1 - b1 ** t) * math.sqrt(r) * math.sqrt((1 - b2 ** t) / (1 - b2))


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - BF16_MANTISSA)


def moment_rel(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every `.exp_avg` tensor together."""
    keys = sorted(k for k in b if k.endswith(".exp_avg"))
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in keys)
    den = sum(float(b[k].double().square().sum()) for k in keys)
    return math.sqrt(num / den) if den else float("nan")


def compare(run: dict, ref: dict, control: dict, lr: float, steps: int, betas=(0.9, 0.98)) -> dict:
    drift = 2 * lr * sum(adam_step_bound(t, *betas) for t in range(1, steps + 1))
    worst, worst_name, over = 0.0, "", 0
    for k, w in ref["model"].items():
        if not w.is_floating_point():
            continue
        a, b = run["model"][k].float(), w.float()
        bound = bf16_ulp(torch.maximum(a.abs(), b.abs())) + drift
        ratio = float(((a - b).abs() / bound).max()) if a.numel() else 0.0
        over += int(((a - b).abs() > bound).sum())
        if ratio > worst:
            worst, worst_name = ratio, k
    masters = [k for k in ref["optim"] if k.endswith(".master")]
    master_diff, master_over = 0.0, 0
    for k in masters:   # the same drift, plus the fp32 rounding of each step's update (2 ulps a step)
        a, b = run["optim"][k], ref["optim"][k]
        d = (a - b).abs()
        master_diff = max(master_diff, float(d.max()) if d.numel() else 0.0)
        master_over += int((d > drift + 2 * steps * FP32_EPS * torch.maximum(a.abs(), b.abs())).sum())
    rel, floor = moment_rel(run["optim"], ref["optim"]), moment_rel(control["optim"], ref["optim"])
    limit = MOMENT_FACTOR * floor + MOMENT_FLOOR
    # the run's old log-probs are rank 0's data shard: the first rows of the batch
    dlogp = max(float((run["old"][k] - ref["old"][k][:len(run["old"][k])]).abs().max()) for k in ref["old"])
    return {"weights": {"bound": f"one bf16 ulp + 2 lr sum_t a_t = ulp + {drift:.3g}", "elements_over": over,
                        "worst_diff_over_bound": worst, "worst_tensor": worst_name, "ok": over == 0},
            "masters": {"max_abs_diff": master_diff, "bound": f"2 lr sum_t a_t = {drift:.3g} (+ 2 fp32 ulps a step)",
                        "elements_over": master_over, "ok": master_over == 0},
            "first_moments": {"rel_diff_run_vs_ref": rel, "rel_diff_control_vs_ref": floor, "limit": limit,
                              "ok": rel <= limit},
            "old_logprobs_max_abs_diff": dlogp}


# ---------------------------------------------------------------------------------------------- memory
def memory(args_: list, run_out: str, fit_lens, device: str) -> dict:
    """Each rank's allocator peak (train.py's `memory` record) next to the planner's GPU bytes for its rank."""
    from nanoflash.cli import model_config, parse_args
    from nanoflash.parallel import planner
    from nanoflash.rl.metrics import read_jsonl
    cfg = parse_args(args_ + ["--parallel.pp", "2", "--parallel.ep", "2", "--parallel.colocate_ranks", "true"])
    mcfg = model_config(cfg)
    fit = planner.measure_layer_bytes(mcfg, fit_lens, device=device)
    seq = 16 + cfg.rollout.max_new_tokens - 1
    setup = dataclasses.replace(planner.setup_from_run(cfg, mcfg, world=4, gpus_per_host=1), seq_len=seq)
    rows = planner.plan(mcfg, cfg.parallel, fit, dtype=torch.bfloat16, setup=setup)
    by = {(r["pp_rank"], r["ep_rank"]): r for r in rows}
    recs = read_jsonl(os.path.join(run_out, "metrics.jsonl"), "memory")
    peaks = recs[-1]["gpu_peak_gib_per_rank"] if recs else [None] * 4
    per_rank = []
    for rank in range(4):
        r = by[(rank // 2, rank % 2)]
        per_rank.append({"rank": rank, "pp": rank // 2, "ep": rank % 2, "measured_peak_gib": peaks[rank],
                         "planned_gib": r["gpu_bytes"] / GIB,
                         "planned_terms_gib": {k: round(v / GIB, 4) for k, v in r["gpu_terms"].items() if v}})
    table = [f"rank {r['rank']} (pp {r['pp']}, ep {r['ep']}): measured peak "
             f"{r['measured_peak_gib'] if r['measured_peak_gib'] is None else round(r['measured_peak_gib'], 2)} GiB, "
             f"planned {r['planned_gib']:.2f} GiB" for r in per_rank]
    return {"table": table, "per_rank": per_rank, "planned_sum_gib": sum(r["gpu_bytes"] for r in rows) / GIB,
            "cuda_context_gib_per_rank": planner.CUDA_CONTEXT_BYTES / GIB, "seq_len": seq}


# ---------------------------------------------------------------------------------------------- the docs' table
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
TABLE = ("<!-- COLOCATED_TABLE: bench/colocated_gpu.py --write-docs -->", "<!-- /COLOCATED_TABLE -->")


def table(doc: dict) -> str:
    """docs/benchmarks.md's rendering of one result: the run, the three comparisons, memory per rank."""
    c, m, r = doc["compare"], doc["memory"], doc["run"]
    fm = c["first_moments"]
    rows = ["| measured | value |", "|---|---|",
            f"| device, torch | {doc['device']}, {doc['torch']} |",
            f"| 4-rank run (PP2 x EP2, {doc['steps']} GRPO steps), wall | rc {r['rc']}, {r['wall_s']:.1f} s |",
            f"| weights over the bound ({c['weights']['bound']}) | {c['weights']['elements_over']} elements; "
            f"worst diff / bound {c['weights']['worst_diff_over_bound']:.3f} ({c['weights']['worst_tensor']}) |",
            f"| AdamW masters over the bound | {c['masters']['elements_over']} elements; max diff "
            f"{c['masters']['max_abs_diff']:.3g} |",
            f"| first moments, run vs one process (relative) | {fm['rel_diff_run_vs_ref']:.4f} |",
            f"| first moments, re-split control vs one process | {fm['rel_diff_control_vs_ref']:.4f} "
            f"(limit {fm['limit']:.4f}) |",
            f"| old log-probs, run vs one process (max abs) | {c['old_logprobs_max_abs_diff']:.4f} |"]
    for p in m["per_rank"]:
        rows.append(f"| rank {p['rank']} (pp {p['pp']}, ep {p['ep']}): allocator peak / planner | "
                    f"{p['measured_peak_gib']:.2f} / {p['planned_gib']:.2f} GiB |")
    peak = r["nvidia_smi_peak_gib"]
    rows.append(f"| GPU in use (nvidia-smi peak) / planner sum + {len(m['per_rank'])} CUDA contexts | "
                f"{'n/a' if peak is None else f'{peak:.2f}'} / "
                f"{m['planned_sum_gib'] + len(m['per_rank']) * m['cuda_context_gib_per_rank']:.2f} GiB |")
    rows.append(f"| all bounds met | {doc['ok']} |")
    return "\n".join(rows)


def write_docs(src: str) -> int:
    with open(src) as f:
        doc = json.load(f)
    write_block(DOC, TABLE, table(doc))
    return 0


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="", help="write the JSON result here (e.g. docs/results/...json)")
    ap.add_argument("--workdir", default="", help="run directory (default: a temporary one, removed)")
    ap.add_argument("--timeout", type=float, default=420.0,   # the H200 run took 164 s (Triton compiles in 4 ranks)
                    help="seconds the 4-rank run may take")
    ap.add_argument("--write-docs", metavar="JSON", help="only render docs/benchmarks.md's table from this result")
    ap.add_argument("--sync-port", type=int, default=29600, help="first port of the per-stage update groups")
    a = ap.parse_args(argv)
    if a.write_docs:
        return write_docs(a.write_docs)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (--device cpu runs the same on the CPU)")
    mode, t0 = MODES[a.device], time.time()
    work = a.workdir or tempfile.mkdtemp(prefix="colocated-")
    os.makedirs(work, exist_ok=True)
    start, out = os.path.join(work, "start"), os.path.join(work, "run")
    doc = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "steps": a.steps,
           "torch": torch.__version__, "preset": mode["preset"], "model_overrides": mode["model"]}
    try:
        write_start(start, mode, seed=0)
        say(t0, "start checkpoint written")
        args_ = run_args(mode, start, out, a.steps, a.sync_port)
        doc["run"] = run_colocated(args_, work, a.timeout, a.device == "cuda")
        ok = doc["run"]["rc"] == 0
        say(t0, f"4-rank run: rc {doc['run']['rc']} in {doc['run']['wall_s']} s")
        if ok:
            ckpt = os.path.join(out, "checkpoints", f"step_{a.steps:08d}")
            replay_dir = os.path.join(out, "replay")
            t1 = time.time()
            ref = replay(args_, replay_dir, a.steps)
            say(t0, "one-process replay done")
            control = replay(args_, replay_dir, a.steps, str(int(mode["flags"][mode["flags"].index(
                "--parallel.micro_batch_tokens") + 1]) // 2))
            got = run_state(args_, ckpt)
            got["old"] = {k: torch.load(os.path.join(replay_dir, f"step_{k}.pt"), weights_only=True)["old"]
                          for k in range(1, a.steps + 1)}
            doc["replay_s"] = round(time.time() - t1, 1)
            say(t0, "control replay and the run's state loaded")
            doc["compare"] = compare(got, ref, control, lr=LR, steps=a.steps)
            doc["memory"] = memory(args_, out, mode["fit_lens"], a.device)
            ok = all(doc["compare"][k]["ok"] for k in ("weights", "masters", "first_moments"))
        doc["ok"] = ok
    finally:
        doc["total_s"] = round(time.time() - t0, 1)
        text = json.dumps(doc, indent=1, default=lambda v: round(v, 6) if isinstance(v, float) else str(v))
        print(text, flush=True)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                f.write(text + "\n")
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if doc.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""GRPO for DeepSeek-V4 (nanoflash), the whole loop in one file. It reads top to bottom:

    config -> dist init -> trainer (meta build -> parallelize -> materialise on this rank's device -> init/load)
    -> warm-up -> optimizer -> collector + pusher -> loop {collect -> step -> push -> eval / save / log}

Runs (see docs/demo.md):
    python train.py --recipe demo                           # CPU demo: tiny model, arithmetic, embedded FP8 server
    python train.py --recipe smoke --rollout.weights fp32   # matched precision: train/rollout |dlogp| == 0
    torchrun --nproc-per-node 2 train.py --recipe smoke --parallel.pp 2
    python train.py --recipe flash --dry-run                # per-GPU memory plan of the 4-node deployment
    torchrun --nnodes 2 --nproc-per-node 8 ... train.py --recipe flash --rollout.urls http://r0:30000,...

One step (Miles' synchronous loop, rl_notes §1-3): rollout n samples per prompt through the SGLang-
protocol servers with dynamic sampling, every request of a round in flight and the tail aborted once the step
has its groups (`rl/rounds.py`) -> rewards -> group advantages -> the trainer recomputes log-probs -> one GRPO
optimizer step (micro-batches by token budget, PP/EP/DP engine) -> FP8 (or matched-precision) weight push,
verified by checksum -> every N steps an offline pass@k eval on held-out problems -> checkpoint -> JSONL.
`--rollout.async true` runs step k+1's rollout while step k trains, the push at the boundary (Miles'
train_async.py; `rl/schedule.py`); `--rollout.partial true` carries the tail's unfinished samples over.

Differs from Miles: no Ray; rank 0 drives the rollout servers over HTTP, then sends each first-stage rank
only its data shard's tensors (the other ranks wait on a gloo side group with a long timeout); one optimizer
step per rollout (the V4 recipe), no fully-async producer, no reference model (KL coef 0).

Instruments (the live FP8-floor checks of experiments/h200, ...) attach through `--train.hooks module:Class`
(`nanoflash/rl/hooks.py`); the loop never names one.

Failures: a crash resumes from the last checkpoint (re-run the command); Ctrl-C stops within seconds with one
line naming it (`rl/interrupt.py`); a non-finite step is skipped on every
rank; a rollout server that dies (or loses the weights) during a rollout, an eval or a push is, within
`rollout.max_server_restarts`, waited for, re-pushed and what failed redone (`rl/restarts.py`, one policy for
all three); else one line, stop.

Tests: `pytest tests/test_train_cli.py tests/test_train_e2e.py -q`.
"""
import os
import signal
import time

T_START = time.time()  # start-up phases are timed from here (the `startup` record)
# Ctrl-C before start-up is over has nothing to undo: one line, exit 130 (then rl/interrupt.py takes over)
signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted at start-up\n"), os._exit(130)))

import dataclasses  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from nanoflash.cli import startup, to_dict
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import latest_checkpoint, load_file
from nanoflash.parallel.dims import all_gather_values, init_distributed, print0, shutdown_distributed
from nanoflash.rl.collector import Collector, eval_seeds
from nanoflash.rl.evaluate import evaluate
from nanoflash.rl.hooks import HookContext, Hooks
from nanoflash.rl.interrupt import Interrupt
from nanoflash.rl.metrics import MetricsLog
from nanoflash.rl.plots import write_plots
from nanoflash.rl.restarts import ServerRestarts
from nanoflash.rl.schedule import STATE_FILE, make_schedule
from nanoflash.rl.trainer import Trainer, gather_full_state, make_optimizer
from nanoflash.sglang.buckets import optimizer_storage
from nanoflash.sglang.push import StagePusher

# ---------------------------------------------------------------------------------------------- config
# --help, overrides, checks, the task's data and reward, the run directory: a user error is one line, exit 2
cfg, mcfg, task = startup(sys.argv[1:])
tc, gc, oc, par, rc, ec = cfg.train, cfg.grpo, cfg.optim, cfg.parallel, cfg.rollout, cfg.eval
if tc.threads:
    torch.set_num_threads(tc.threads)
matched = rc.weights == "fp32" and tc.dtype == "fp32"  # batch-invariant scoring: |dlogp| must be exactly 0
if matched:  # matched precision: the deterministic reference path, never a kernel (atomics, other reductions)
    mcfg = dataclasses.replace(mcfg, kernels="reference")
ckpt_dir = os.path.join(tc.out_dir, "checkpoints")
# Ctrl-C: the queued requests cancelled, the running ones aborted, one line ("interrupted at step N; last
# checkpoint ...; re-run the same command to resume"), exit 130; a second press exits at once
interrupt = Interrupt(ckpt_dir, rank0=int(os.environ.get("RANK", "0")) == 0)
ckpt_is_dcp = bool(tc.checkpoint) and os.path.exists(os.path.join(tc.checkpoint, "meta.json"))  # else HF layout

# ---------------------------------------------------------------------------------------------- dist init
phases = {"imports_config_s": time.time() - T_START}  # start-up: where the minutes before step 1 go
dims = init_distributed(par.pp, par.ep, par.dp, timeout_s=par.timeout_s, wait_timeout_s=par.wait_timeout_s,
                        colocate=par.colocate_ranks)
rank0 = dims.rank == 0
torch.manual_seed(tc.seed)

# ---------------------------------------------------------------------------------------------- trainer
t_phase = time.time()
trainer = Trainer(cfg, mcfg, dims, tc.checkpoint, ckpt_is_dcp, served_storage=optimizer_storage(cfg, mcfg))
phases["trainer_s"] = time.time() - t_phase  # build, place, seeded init or checkpoint load
print0(f"trainer: {dims}, stage on {trainer.device}, {sum(p.numel() for p in trainer.model.parameters()) / 1e6:.1f}M "
       f"parameters on this rank" + (f", allocator capped at {trainer.memory_cap_gib:.1f} GiB" if trainer.memory_cap_gib else ""))
if not tc.resume and latest_checkpoint(ckpt_dir):  # never prune or later adopt another run's checkpoints
    raise SystemExit(f"--train.resume false, but {ckpt_dir} holds checkpoints of an earlier run (newest: "
                     f"{os.path.basename(latest_checkpoint(ckpt_dir))}); choose another --out, or resume it")
step, pos, (latest, meta) = 0, 0, trainer.resume(ckpt_dir) if tc.resume else (None, None)
if latest:
    step, pos = meta["step"], meta["extra"]["data_pos"]
    print0(f"resumed from {latest}: step {step}, data position {pos}")
log = MetricsLog(os.path.join(tc.out_dir, "metrics.jsonl"), resume_step=step if latest else None,
                 tensorboard=tc.tensorboard, wandb=tc.wandb, config=to_dict(cfg), enabled=rank0)
if not latest:
    log.log("info", 0, {"config": to_dict(cfg), "world_size": dims.world_size, "matched": matched})
if not latest and tc.warmup_steps:  # supervised warm-up on task.warmup (train.warmup_data; fresh runs only)
    sft_opt, t0 = make_optimizer(trainer.model, oc, lr=tc.warmup_lr), time.time()
    for i in range(tc.warmup_steps):
        batch_probs = [task.warmup[(i * tc.warmup_batch + j) % len(task.warmup)] for j in range(tc.warmup_batch)]
        nll = trainer.sft_step(batch_probs, task, sft_opt)
        if i % 25 == 0 or i == tc.warmup_steps - 1:
            log.log("warmup", i, {"nll": nll, "time_s": time.time() - t0})
    del sft_opt
t_phase = time.time()
if trainer.optimizer is None:
    trainer.start_optimizer()  # the fp32 master is taken from the weights as loaded / warmed up, never before
phases["optimizer_s"] = time.time() - t_phase

# ---------------------------------------------------------------------------------------------- collector, pusher
# Weights reach the servers from every pipeline stage's own ranks (sglang.push). Rank 0 gathers a full copy
# once, only to start embedded servers from (`gather_full_state`); real SGLang loads its own. Embedded servers
# run on the CPU beside a multi-GPU trainer, on the one GPU when the ranks share it (`colocate_ranks`).
full_state = gather_full_state(trainer) if dims.world_size > 1 and not rc.urls else None
with torch.device(trainer.device if par.colocate_ranks else "cpu"):
    shadow = trainer.model if dims.world_size == 1 else (Transformer(mcfg) if full_state is not None else None)
if shadow is not None and full_state is not None:
    shadow.load_state_dict(full_state)
t_phase = time.time()
collector = Collector(cfg, task, mcfg, shadow, pos) if rank0 else None  # embedded servers, or waits for SGLang
pusher = StagePusher(dims, collector.client if rank0 else None, rc, mcfg, disk_dir=os.path.join(tc.out_dir, "sync"))
phases["servers_s"] = time.time() - t_phase
restarts = ServerRestarts(rc, dims, collector.client if rank0 else None, pusher, log.log)  # rollout, eval, push
hooks = Hooks(tc.hooks, None)  # instruments (--train.hooks), built on rank 0 after the first push
# synchronous, or step k+1's rollout beside step k (rollout.asynchronous); what the last checkpoint left pending
schedule = make_schedule(collector, rc, tc.steps, dims, served=step)
if latest and rank0 and load_file(latest, STATE_FILE) is not None:
    schedule.load_state_dict(load_file(latest, STATE_FILE), step)


def push(version: int, restarted: bool = False) -> dict:
    """Each stage pushes its own slice to every server, verified (collective; rank 0 reports)."""
    t0 = time.time()
    info = restarts.push(trainer.state_iter, version, restarted=restarted)
    schedule.pushed(version)
    if not rank0:
        return {}
    return {"sync_s": time.time() - t0, "sync_tensors": info["tensors"], "sync_buckets": info["buckets"],
            "sync_bytes": info["bytes"], "sync_layout_sha": info.get("layout_sha"),
            "sync_verified": len(info.get("verified") or {}), **hooks.after_push(version)}   # servers checked


def gen_at(at: int):
    """The eval's generate function at step `at`: the weights the servers hold, the eval's seeds of that step."""
    return lambda prompts, n: collector.eval_generate(prompts, n, eval_seeds(tc.seed, at, len(prompts)))


def run_eval(at: int) -> None:
    """pass@k on held-out problems of the weights the rollout servers hold, just pushed (rank 0): in-process on
    the embedded engine or through the servers (`eval.path`, `Collector.eval_generate`). Collective: a server
    that died or lost the weights is never scored; the restart policy re-pushes and the eval is redone."""
    if not ec.every:
        return
    t0 = time.time()
    res = restarts.run(f"eval at step {at}", at, lambda: evaluate(task.heldout, gen_at(at), ec.k_samples, task.reward,
                                                                  ec.max_new_tokens, task.encode))
    if not rank0:
        return
    acc = torch.tensor(res.pop("per_problem_correct"), dtype=torch.float64) / ec.k_samples  # [P] per problem
    passk = [k for k in res if k.startswith("pass@") and not k.endswith("_se")]
    print0(f"eval step {at}: " + " ".join(f"{k}={res[k]:.3f}+-{res[k + '_se']:.3f}" for k in passk))
    log.log("eval", at, {**res, "chance": task.chance, "eval_s": time.time() - t0})
    for record, m in hooks.after_eval(at, acc, gen_at).items():
        log.log(record, at, m)


def save(at: int) -> None:
    if tc.save_every < 0:  # no checkpoints at all (throughput runs: the `gpu` recipe)
        return
    data_pos = collector.pos if rank0 else None
    trainer.save(ckpt_dir, at, extra={"data_pos": data_pos, "model_config": dataclasses.asdict(mcfg),
                                      "run_config": to_dict(cfg)}, keep=tc.keep,  # the run's identity (cli.py)
                 async_save=tc.async_save,   # async: written during the next rollout, waited for before its update
                 files={STATE_FILE: schedule.state_dict()} if rank0 else None)


t_phase = time.time()
push(step)
phases["first_push_s"] = time.time() - t_phase
if tc.hooks and rank0:  # probe after every push, FP8 floor, |dlogp| tails, ... (one process)
    hooks = Hooks(tc.hooks, HookContext(cfg, mcfg, trainer, collector, pusher, task))
    log.log("push", step, hooks.after_push(step))
phases["total_s"] = time.time() - T_START
print0("start-up: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in phases.items()))
log.log("startup", step, phases)
if not latest:
    if ec.before_train:
        run_eval(0)
    if not tc.checkpoint or tc.warmup_steps:  # a start loaded as it is from --train.checkpoint is on disk already
        save(0)                               # (flash: no 3.9 TB save of it); a resume before step 1 reloads it

# ---------------------------------------------------------------------------------------------- loop
streak = total_skipped = 0  # consecutive / all skipped (non-finite) steps
try:
    while step < tc.steps:
        t0, interrupt.at = time.time(), step + 1
        # a server lost: wait, re-push, redo from the same data position (same prompts and seeds): rl/restarts.py
        batch, m = restarts.run(f"rollout for step {step + 1}", step + 1, lambda: schedule.take(step + 1)) \
            or (None, {})   # one step off, take() also starts step + 2's rollout beside this step
        tm = trainer.step(batch, step + 1, before_update=lambda b, old: hooks.before_update(b, old, step + 1))
        step, m = step + 1, {**m, **tm}
        skipped = m.pop("skipped", False)
        streak, total_skipped = (streak + 1 if skipped else 0), total_skipped + skipped
        m["skipped_steps"] = total_skipped
        if skipped:  # non-finite loss or gradient norm: no update happened on any rank; nothing to push or save
            print0(f"step {step}: SKIPPED (loss {m['loss']}, grad norm {m['grad_norm']}): non-finite, no update, "
                   f"no push, no checkpoint ({streak} in a row, {total_skipped} in total)")
            if streak >= tc.max_skipped_steps:
                log.log("train", step, {**m, "step_s": time.time() - t0})
                raise SystemExit(f"diverged: {streak} consecutive non-finite steps (train.max_skipped_steps="
                                 f"{tc.max_skipped_steps}); the last checkpoint is the last good state")
        eval_due = bool(ec.every) and (step % ec.every == 0 or step == tc.steps)
        save_due = not skipped and (step == tc.steps or bool(tc.save_every and step % tc.save_every == 0))
        push_due = not skipped and schedule.push_due(step, eval_due or save_due or step == tc.steps)
        restarted = False
        if push_due or eval_due:   # the servers are about to change or be read: nothing may run on them
            err = schedule.boundary()   # the rollout beside this step met a restarted server: the policy's
            if err:                     # wait, then this step's weights pushed into it whatever else it does
                restarts.recover(f"rollout for step {step + 1}", step, err)
                push_due = restarted = True
            m["boundary_wait_s"] = schedule.waited
        if push_due:
            m.update(push(step, restarted))
        if trainer.device.type == "cuda":  # this rank's stage, optimizer and activations (rank 0's, as logged)
            m.update(gpu_mem_gib=torch.cuda.memory_allocated() / 2 ** 30,
                     gpu_peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
        if rank0:
            print(f"step {step}: reward {m['reward_mean']:.3f} kept {m['groups_kept']}/{m['groups_seen']} groups "
                  f"|dlogp| {m.get('train_rollout_logprob_abs_diff', float('nan')):.2e} ({time.time() - t0:.1f}s)",
                  flush=True)
        log.log("train", step, {**m, "step_s": time.time() - t0})
        if eval_due:
            run_eval(step)
        if save_due:
            save(step)
except KeyboardInterrupt:   # the rollout running beside the step (one step off): cancelled and aborted, then
    schedule.cancel()       # rl/interrupt.py's one line
    raise

# ---------------------------------------------------------------------------------------------- wrap up
trainer.finish_save()   # the last checkpoint, when written asynchronously
if trainer.device.type == "cuda":   # every rank's own allocator peak (ranks sharing one GPU: one each)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    log.log("memory", step, {"gpu_peak_gib_per_rank": all_gather_values(dims, peak)})
if rank0 and tc.plots:
    for path in write_plots(tc.out_dir):
        print(f"wrote {path}")
hooks.close()
log.close()
schedule.close()
if collector is not None:
    collector.close()
shutdown_distributed(dims)

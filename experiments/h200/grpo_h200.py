"""Issue 20's warm start and report: SFT of the h200 preset on the synthetic task, and the run's summary.

    python experiments/h200/grpo_h200.py sft --out /tmp/warm [train.py overrides ...]    # GPU (or --parallel.device cpu)
    python experiments/h200/grpo_h200.py report --run runs/h200 --out experiments/h200          # stats + figures, no GPU
    python experiments/h200/grpo_h200.py warmup --url http://127.0.0.1:30000             # while the SFT runs
    python experiments/h200/grpo_h200.py calibrate_long --out /tmp/cl.json --arms curriculum --near-share 1.0  # CPU

`sft` trains the model the recipe `h200.txt` (beside this file) describes (same preset, dtype, optimizer, device) from its seeded init in
two phases (`cmd_sft`): worked demonstrations of the training split until validation pass@1 reaches --target (the
steps learned), then a mix that is mostly answers at a glance (`synth.sft_pairs`) until P(worked) on the
validation prompts (`p_worked`: exact, one forward) is at most --worked-max -- a warm start that can work sums
out but seldom does, leaving GRPO room (pass@1 ~ P(worked) x acc(worked) + the rest x acc(glance)). Validation
pass@1 samples VAL_PROBLEMS problems x VAL_SAMPLES at temperature 1 in-process (`collector.sample_batched`, the
embedded engine's sampler), scored by the task's own reward. It writes the weights as an SGLang-servable
checkpoint (FP8 128x128 linears, FP8 experts: what the server will hold) plus sft.json (the curve of both
phases, why each stopped). The validation split is disjoint from the held-out one, so no stopping rule looks at
an eval problem.

The task is the recipe's `train.data` (`py:experiments.h200.<module>:<family>:<split>`: synth.py's sums, or
longctx.py's long-context facts, issue 42), or `--sft-data` for the SFT's problems (the long run's short-heavy
`factssft`) and `--val-data` for its validation problems. With `--val forced` (the long run: sampling a 3K-token
prompt in-process recomputes the whole sequence per token) the stopping rule reads `forced_accuracy` instead:
one teacher-forced forward per problem of the canonical worked response, a problem counting as right when
every number token of it (the looked-up values, the partial sums, the answer) is the argmax -- greedy pass@1 of
the worked chain -- reported per length class at the end (`longctx.length_class`).

With `--curriculum SPEC` (the long run, issue 42: three minutes of `factssft` alone taught the lookup nothing)
phase 1 is a schedule of families instead, easy to hard (experiments/h200/curriculum.py: each phase until the
teacher-forced accuracy on --val-problems of its own family's val split reaches its `acc=`, or its `s=` / `steps=`
budget is spent; the last until --max-seconds), checked every --check-every steps; phase 2 then trains on the
last phase's family, the final check reads --val-data as before, and sft.json records each phase ("curriculum":
family, steps, seconds, the accuracy at each check, why it ended). Without it nothing changes.

`warmup` sends a fresh SGLang a rollout's worth of requests (the task's first training prompts, `n` samples
each, all at once) as soon as its HTTP server answers: SGLang compiles its kernels (DeepGEMM,
flashinfer, tilelang, Triton) in the first forwards -- 4.6 minutes before /health answered, then ~2 more in the
first eval's shapes, in 2026-12-01's run 3 -- so they overlap the SFT instead of delaying GRPO.

`calibrate_long` (CPU, `tiny` with the h200 attention geometry, a compact vocabulary) trains the long task's
SFT and records, per check, the teacher-forced accuracy of the worked chain, of its two looked-up values and of
the two fact letters it copies from the question (`cmd_calibrate_long`; experiments/h200/README.md, "A CPU study").

`report` reads metrics.jsonl (and parity.json, sft.json when present) and writes summary.json and the figures
(`instruments.runstats`).

`compare` (issue 41, `H20_COMPARE=1 grpo_h200.sh`) reads the synchronous and the one-step-off run of one warm
start and writes compare.json: per run the step time (mean and median of steps 2..N: step 1 of a one-step-off
run has no rollout beside it), its parts (rollout, trainer waiting for it, train, push), the train-rollout gap
(train_rollout_logprob_abs_diff, and TIS's exp(old - rollout)), staleness, samples generated per sample trained,
held-out pass@1 with its SE at every eval, the pushes (every one verified by SGLang's own checksums, or the run
stops), trainer memory and, from gpu.csv, the GPU's utilisation and memory while each ran; then the bars: async
step time <= 0.7x sync, pass@1 at the last common eval within 2 SE of the difference, every push verified.
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time

import torch

from nanoflash.rl import collector, data, trainer
from nanoflash.sglang.buckets import optimizer_storage
import importlib

from experiments.h200 import curriculum, glance, synth
from nanoflash import grpo
from nanoflash.checkpoint import save_hf_checkpoint
from nanoflash.cli import parse_args
from nanoflash.config import run_preset
from nanoflash.parallel.dims import init_distributed
from nanoflash.parallel.train_step import train_step

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200.txt")   # the run's recipe
CHECK_EVERY = 10      # SFT steps between validation checks
VAL_PROBLEMS = 32     # validation problems per check
LOOKUPS = 2          # the long task's lookups: a chain's first two numbers are the values looked up in the prompt
VAL_SAMPLES = 2       # samples per validation problem (temperature 1): 64 draws, SE <= 0.06
SFT_LR_WARMUP = 10    # linear learning-rate warm-up steps of the SFT


def task_module(spec: str):
    """`py:experiments.h200.<module>:<family>:<split>` -> (the module, family, split); one error otherwise."""
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] != "py" or not parts[1].startswith("experiments.h200."):
        raise ValueError(f"{spec!r}: the h200 tasks are named py:experiments.h200.<synth|longctx>:<family>:<split>")
    return importlib.import_module(parts[1]), parts[2], parts[3]


def numbers_at(ids: list, tok) -> list:
    """Indices of the tokens of `ids` that are numbers (the values a worked response must get right)."""
    return [i for i, t in enumerate(ids) if tok.decode([t]).strip().isdigit()]


def letters_at(ids: list, tok) -> list:
    """Indices of the tokens of a worked long-task response that name a fact (`a` of `a5`: a lone letter
    followed by a digit), the tokens copied from the question rather than looked up."""
    text = [tok.decode([t]).strip() for t in ids]
    return [i for i in range(len(ids) - 1) if len(text[i]) == 1 and text[i].isalpha() and text[i + 1].isdigit()]


@torch.no_grad()
def forced_hits(model, prompt: list, resp: list, at: list) -> list:
    """One teacher-forced forward of prompt + resp: for each position of `at`, is the argmax there resp's token?"""
    x = torch.tensor([prompt + resp[:-1]], device=next(model.parameters()).device)
    h = model.run_layers(model.embed_streams(x), x)[:, len(prompt) - 1:]                  # [1,R,M,D]
    pred = model.logits(h)[0].argmax(-1).tolist()                                       # [R]
    return [pred[i] == resp[i] for i in at]


def forced_accuracy(model, tok, module, probs: list) -> dict:
    """Teacher-forced greedy check of the canonical worked response (`module.solution(prompt)`): a problem is
    right when the argmax at every number token of it is that token; its lookup is right when the first two
    (the values looked up in the prompt, `a5\\nc2` of the long task) are. One forward per problem (prompts differ
    in length). -> {"all": share right, "lookup": share looked up, <class>: ..., <class>_lookup: ...} (classes by
    `length_class`, when the module names them)."""
    hits = []
    for p in probs:
        prompt, resp = tok.encode_chat(p), tok.encode(module.solution(p.prompt)) + [tok.eos_id]
        hits.append(forced_hits(model, prompt, resp, numbers_at(resp, tok)))
    right, look = [all(h) for h in hits], [all(h[:LOOKUPS]) for h in hits]
    out = {"all": sum(right) / len(right), "lookup": sum(look) / len(look)}
    if hasattr(module, "length_class"):
        for cls in sorted({module.length_class(p) for p in probs}):
            idx = [i for i, p in enumerate(probs) if module.length_class(p) == cls]
            out[cls] = sum(right[i] for i in idx) / len(idx)
            out[f"{cls}_lookup"] = sum(look[i] for i in idx) / len(idx)
    return out


def sft_batch_step(actor, pairs: list, optimizer, pad_id: int) -> float:
    """One supervised step: -mean log p(response | prompt) over response tokens (actor.sft_step's loss, with the
    response given instead of derived from the answer)."""
    eps = [grpo.Episode(p, r, [0.0] * len(r), 0.0, i) for i, (p, r) in enumerate(pairs)]
    batch = grpo.pack(eps, torch.zeros(len(eps)), pad_id)
    mbs, _ = actor.micro_batches(batch, ("input_ids", "targets", "mask"))
    mbs = [{"input_ids": mb["input_ids"], "targets": mb["targets"], "loss_mask": mb["mask"]} for mb in mbs]
    n_tok = float(batch.mask.sum())
    return train_step(actor.model, actor.dims, mbs, optimizer, 1.0 / n_tok, grad_clip=actor.oc.grad_clip)["loss"]


def val_pass1(actor, task, val: list, seed: int, max_new: int) -> float:
    """Mean reward of VAL_SAMPLES samples per validation problem at T = 1, sampled in-process."""
    prompts = [task.encode(p) for p in val]
    seeds = [seed * 7919 + i for i in range(len(val))]
    out = collector.sample_batched(actor.model, prompts, VAL_SAMPLES, max_new, 1.0, list(task.stop_ids), seeds)
    flat = [p for p in val for _ in range(VAL_SAMPLES)]
    rs = task.reward(flat, [ids for group in out for ids, _ in group])
    return sum(rs) / len(rs)


@torch.no_grad()
def p_worked(model, prompts: list, think_end: int) -> float:
    """Mean over prompts of P(first response token != `</think>`): the chance the policy works the sum out,
    exactly, from one forward per prompt length (no sampling). prompts: lists of ids -> a float."""
    dev, ps = next(model.parameters()).device, []
    for n in sorted({len(p) for p in prompts}):
        x = torch.tensor([p for p in prompts if len(p) == n], device=dev)          # [b, n]
        h = model.run_layers(model.embed_streams(x), x)[:, -1:]                  # [b, 1, M, D]
        last = model.logits(h)[:, 0].softmax(-1)                                  # [b, V]
        ps += (1.0 - last[:, think_end]).tolist()
    return sum(ps) / len(ps)


def cmd_sft(a, overrides):
    """Phase 1 (`worked`): worked demonstrations only, until validation pass@1 reaches --target or --max-seconds
    pass. Phase 2 (`glance`, at --glance-lr, cut near the mark by glance.run): demonstrations worked with
    probability --glance-share, else at a glance (synth.sft_pairs), until P(worked) on the validation prompts is at
    most --worked-max, checked every step (at most --glance-steps, and --glance-seconds when given): a warm start
    that can work sums out but seldom does (synth's docstring)."""
    cfg = parse_args(["--recipe", RECIPE, *overrides])
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    mcfg = run_preset(cfg)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    tok = _tokenizer()
    module, family, _ = task_module(a.sft_data or cfg.train.data)
    sft_train = module.problems(family, "train", seed=cfg.train.seed) if a.sft_data else task.train
    vmod, vfamily, _ = task_module(a.val_data) if a.val_data else (module, family, None)
    think_end = tok.encode(data.THINK_END)
    if len(think_end) != 1:
        raise ValueError(f"{data.THINK_END!r} is {think_end} in this tokenizer; P(worked) needs it as one token")
    think_end = think_end[0]
    torch.manual_seed(cfg.train.seed)
    rng = random.Random(cfg.train.seed)
    actor = trainer.Trainer(cfg, mcfg, init_distributed(1, 1, None), served_storage=optimizer_storage(cfg, mcfg))
    val = vmod.problems(vfamily, "val")[:a.val_problems]
    val_prompts = [task.encode(p) for p in val]
    opt = trainer.make_optimizer(actor.model, cfg.optim, lr=a.lr)
    curve, t0, i, why, nll = [], time.time(), 0, {}, float("nan")

    def check(phase: str, sample: bool) -> dict:
        row = {"step": i, "phase": phase, "nll": nll,
               "p_worked": round(p_worked(actor.model, val_prompts, think_end), 4)}
        if sample and a.val == "forced":
            acc = forced_accuracy(actor.model, tok, vmod, val)
            row["val_pass@1"], row["val_forced_by_class"] = acc["all"], acc
        elif sample:
            row["val_pass@1"] = val_pass1(actor, task, val, i, cfg.eval.max_new_tokens)
        curve.append({**row, "time_s": round(time.time() - t0, 1)})
        print(json.dumps(curve[-1]), flush=True)
        return row

    def step(share: float, lr: float, probs: list | None = None, k: int = 0, at: int = 0) -> float:
        probs, k, at = probs or sft_train, k or i, at or i               # k: the step within `probs`' phase
        opt.lr = lr * min(1.0, at / SFT_LR_WARMUP)
        batch = [probs[((k - 1) * a.batch + j) % len(probs)] for j in range(a.batch)]
        return sft_batch_step(actor, module.sft_pairs(batch, tok, share, rng), opt, task.pad_id)

    cur = None
    if a.curriculum:                                                     # phase 1 as a curriculum of families
        cur, sft_train, nll = run_curriculum(a, module, actor, tok, step, curve, t0, cfg.train.seed)
        i = sum(r["steps"] for r in cur)
        last = next(r for r in reversed(cur) if r["ended"] != "not_reached")
        why["worked"] = f"curriculum: {last['family']} {last['why']}"
    while i < a.max_steps and "worked" not in why:                       # phase 1: learn the steps
        i += 1
        nll = step(1.0, a.lr)
        if i % a.check_every == 0 and check("worked", True)["val_pass@1"] >= a.target:
            why["worked"] = f"val pass@1 >= target {a.target} at step {i}"
        elif time.time() - t0 > a.max_seconds:
            why["worked"] = f"time limit {a.max_seconds}s at step {i}"
    why.setdefault("worked", f"max steps {a.max_steps}")
    def glance_step(rate: float) -> float:                              # phase 2: mostly at a glance
        nonlocal i, nll
        i += 1
        nll = step(a.glance_share, rate)
        return check("glance", False)["p_worked"]

    ending, _, rates = glance.run(glance_step, a.glance_lr, a.worked_max, a.worked_target, a.glance_steps,
                                  a.glance_seconds)
    why["glance"] = {"worked_max": f"P(worked) <= {a.worked_max} at step {i}",
                     "seconds": f"glance seconds {a.glance_seconds:g} spent at step {i}",
                     "steps": f"max glance steps {a.glance_steps}"}[ending]
    final = check("final", True)
    t1 = time.time()
    info = save_hf_checkpoint(actor.model, a.out, weights="fp8", experts="fp8")
    res = {"steps": i, "stopped": why, "final": final, "sft_s": round(t1 - t0, 1),
           "save_s": round(time.time() - t1, 1), "lr": a.lr, "glance_lr": a.glance_lr, "batch": a.batch,
           "glance_share": a.glance_share, "glance_seconds": a.glance_seconds, "worked_max": a.worked_max,
           "worked_target": a.worked_target, "glance_rates": rates,
           "val_problems": a.val_problems, "check_every": a.check_every,
           **({"curriculum_spec": a.curriculum, "curriculum": cur} if cur is not None else {"target": a.target}),
           "curve": curve, "params": actor.model.full_params, "files": info.get("files")}
    with open(os.path.join(a.out, "sft.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "curve"}), flush=True)


def run_curriculum(a, module, actor, tok, step, curve: list, t0: float, seed: int) -> tuple:
    """Phase 1 of `cmd_sft` as `--curriculum` schedules it (experiments/h200/curriculum.py): each phase's worked
    demonstrations from its family's train split, its checks on --val-problems of that family's val split,
    teacher-forced (`forced_accuracy`). `step(share, lr, probs, k, at)`: cmd_sft's step k of `probs`, the SFT's
    step `at` (the learning-rate warm-up). -> (the phases' records, the last phase's train problems: phase 2's,
    the last step's loss)."""
    phases = curriculum.parse(a.curriculum, getattr(module, "FAMILIES", {}))
    train = {ph.family: module.problems(ph.family, "train", seed=seed) for ph in phases}
    val = {ph.family: module.problems(ph.family, "val")[:a.val_problems] for ph in phases}
    state = {"at": 0, "nll": float("nan")}                     # the SFT's step count and last loss

    def train_step(ph, k):
        state["at"] += 1
        state["nll"] = step(1.0, a.lr, train[ph.family], k, state["at"])

    def accuracy(ph):
        acc = forced_accuracy(actor.model, tok, module, val[ph.family])
        curve.append({"step": state["at"], "phase": f"curriculum:{ph.family}", "nll": state["nll"],
                      "val_pass@1": acc["all"], "val_forced_by_class": acc, "time_s": round(time.time() - t0, 1)})
        print(json.dumps(curve[-1]), flush=True)
        return {"acc": acc["all"], "look": acc["lookup"]}

    def log(rec):
        print(json.dumps({"curriculum_phase": rec}), flush=True)

    recs = curriculum.run(phases, train_step, accuracy, a.max_seconds, a.max_steps, a.check_every, log=log)
    last = next(r for r in reversed(recs) if r["ended"] != "not_reached")
    return recs, train[last["family"]], state["nll"]


def cmd_calibrate(a, overrides):
    """The SFT curve of the task on the CPU with the `tiny` preset: the V4 ids this task uses (~60) renumbered
    to a compact vocabulary so a 2-core CPU can train it (the full 129,280-row head costs ~10 s a step there).
    The same prompts, responses, splits and reward; only the ids are renamed. Writes the curve as JSON."""
    from nanoflash.rl import rewards
    from nanoflash.grpo import Episode  # noqa: F401  (sft_batch_step packs Episodes)
    tok = _tokenizer()
    train, val = synth.problems("sum4", "train"), synth.problems("sum4", "val")[:VAL_PROBLEMS]
    pairs, vpairs = synth.sft_pairs(train, tok), synth.sft_pairs(val, tok)
    used, rid = compact_vocab([s for pr in pairs + vpairs for s in pr])          # V4 id <-> compact id
    pairs = [([rid[t] for t in p], [rid[t] for t in r]) for p, r in pairs]
    cfg = parse_args(["--recipe", RECIPE, "--train.preset", "tiny", "--model.vocab_size", str(len(used)),
                      "--parallel.device", "cpu", "--train.dtype", "fp32", *overrides])
    torch.set_num_threads(cfg.train.threads or 1)
    mcfg = run_preset(cfg)
    torch.manual_seed(cfg.train.seed)
    actor = trainer.Trainer(cfg, mcfg, init_distributed(1, 1, None), served_storage=optimizer_storage(cfg, mcfg))
    opt, eos = trainer.make_optimizer(actor.model, cfg.optim, lr=a.lr), rid[tok.eos_id]

    def reward(probs, ids):
        texts = [tok.decode([used[i] for i in x], True) for x in ids]
        return [float(rewards.integer_match(rewards.extract_answer(t), p.answer)) for t, p in zip(texts, probs)]
    task = collector.Task(train, val, lambda p: [rid[t] for t in tok.encode_chat(p)], None, reward, [eos], eos)
    curve, t0 = [], time.time()
    for i in range(1, a.max_steps + 1):
        opt.lr = a.lr * min(1.0, i / SFT_LR_WARMUP)
        nll = sft_batch_step(actor, [pairs[((i - 1) * a.batch + j) % len(pairs)] for j in range(a.batch)], opt, eos)
        if i % CHECK_EVERY == 0:
            curve.append({"step": i, "nll": nll, "val_pass@1": val_pass1(actor, task, val, i, 40),
                          "time_s": round(time.time() - t0, 1)})
            print(json.dumps(curve[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"vocab": len(used), "lr": a.lr, "batch": a.batch, "params": actor.model.full_params,
                   "curve": curve}, f, indent=1)


LONG_GEOMETRY = ("--model.window_size", "128", "--model.index_topk", "512", "--model.original_seq_len", "65536",
                 "--model.rope_factor", "16", "--model.max_seq_len", "4096")   # tiny, with the h200 attention's geometry
LONG_ARMS = ("mix", "curriculum")


def compact_vocab(seqs) -> tuple:
    """The ids `seqs` use, renumbered 0..n-1: -> (used: compact id -> V4 id, rid: V4 id -> compact id)."""
    used = sorted({t for s in seqs for t in s})
    return used, {t: i for i, t in enumerate(used)}


def forced_items(module, probs: list, tok) -> list:
    """(prompt ids, canonical worked response ids + EOS, its number positions) per problem: what
    `forced_accuracy` scores, in V4 ids."""
    out = []
    for p in probs:
        resp = tok.encode(module.solution(p.prompt)) + [tok.eos_id]
        out.append((tok.encode_chat(p), resp, numbers_at(resp, tok)))
    return out


def cmd_calibrate_long(a, overrides):
    """Does the long task's lookup learn, and does a near-first curriculum beat the mix from the start? On the CPU,
    `tiny` with the h200 attention geometry (LONG_GEOMETRY on top of the recipe's 4 layers, C4/C128/C4, 1 hash
    layer, no MTP; index_topk 512 keeps every C4 entry at these lengths), the V4 ids renumbered as in
    `cmd_calibrate`. Each arm of --arms trains from the same seeded init, batch, lr schedule and --max-steps:
    `mix` on --mix-family (factsmid: 1/3 near, 2/3 sft_mid) throughout, `curriculum` on factsnear for the first
    --near-share of the steps, then on the same mix (from its first batch). Every --check-every steps: the SFT
    loss and the teacher-forced accuracy of the worked chain (`forced_hits`, as `forced_accuracy`) on
    --val-problems near (factsnear val) and sft_mid (factsmid val) problems, `<class>_lookup`: the share
    whose two looked-up values (the chain's first two numbers) are both the argmax, chance ~1/81,
    `<class>_value_tok`: the same two tokens' per-token argmax accuracy, and `<class>_letters`: the share whose
    two fact letters (`a` and `c` of `a5\\nc2`, copied from the question: `letters_at`) are both the argmax,
    `<class>_pos`: per-token accuracy at the two letters, then at each number of the chain in order (the two
    values, then the chain's terms, partial sums and the answer) -- all from the same forward. Near only:
    `--arms curriculum --near-share 1.0`; width etc. by `--model.<field>` overrides (after LONG_GEOMETRY).
    Writes the curves as JSON."""
    from experiments.h200 import longctx
    tok, arms = _tokenizer(), a.arms.split(",")
    if not set(arms) <= set(LONG_ARMS):
        raise ValueError(f"--arms {a.arms!r}: expected a comma-separated subset of {LONG_ARMS}")
    base = ["--recipe", RECIPE, "--train.preset", "tiny", "--parallel.device", "cpu", "--train.dtype", "fp32",
            *LONG_GEOMETRY, *overrides]
    seed = parse_args(base).train.seed
    n_near = round(a.near_share * a.max_steps)
    train = {f: longctx.problems(f, "train", seed=seed) for f in ("factsnear", a.mix_family)}
    plan = {"mix": [(a.mix_family, k) for k in range(1, a.max_steps + 1)],       # (family, step within it)
            "curriculum": [("factsnear", k) for k in range(1, n_near + 1)]
            + [(a.mix_family, k) for k in range(1, a.max_steps - n_near + 1)]}
    pairs = {}                                        # arm -> the batches of its steps (drawn phrasings, one rng)
    for arm in arms:
        rng = random.Random(seed)
        pairs[arm] = [longctx.sft_pairs([train[f][((k - 1) * a.batch + j) % len(train[f])] for j in range(a.batch)],
                                        tok, 1.0, rng) for f, k in plan[arm]]
    val = {"near": longctx.problems("factsnear", "val")[:a.val_problems],
           "mid": [p for p in longctx.problems("factsmid", "val") if longctx.length_class(p) == "sft_mid"][:a.val_problems]}
    items = {c: forced_items(longctx, ps, tok) for c, ps in val.items()}
    used, rid = compact_vocab([s for arm in arms for batch in pairs[arm] for pr in batch for s in pr]
                              + [s for its in items.values() for p, r, _ in its for s in (p, r)])
    ren = lambda ids: [rid[t] for t in ids]                                      # noqa: E731
    lets = {c: [letters_at(r, tok) for _, r, _ in its] for c, its in items.items()}          # 2 per response
    assert all(len(x) == 2 for ls in lets.values() for x in ls), "a worked response names two facts"
    items = {c: [(ren(p), ren(r), l + at) for (p, r, at), l in zip(its, lets[c])] for c, its in items.items()}
    cfg = parse_args([*base, "--model.vocab_size", str(len(used))])
    torch.set_num_threads(cfg.train.threads or 1)
    mcfg, eos = run_preset(cfg), rid[tok.eos_id]
    res = {"vocab": len(used), "lr": a.lr, "batch": a.batch, "steps": a.max_steps, "near_steps": n_near,
           "mix_family": a.mix_family, "val_problems": {c: len(v) for c, v in val.items()},
           "model": {k: getattr(mcfg, k) for k in ("dim", "n_layers", "window_size", "compress_ratios",
                                                     "index_topk", "n_hash_layers", "n_mtp_layers", "kernels")},
           "threads": cfg.train.threads, "arms": {}}
    for arm in arms:
        torch.manual_seed(seed)
        actor = trainer.Trainer(cfg, mcfg, init_distributed(1, 1, None), served_storage=optimizer_storage(cfg, mcfg))
        opt = trainer.make_optimizer(actor.model, cfg.optim, lr=a.lr)
        res["params"], curve, train_s, losses = actor.model.full_params, [], 0.0, []
        print(json.dumps({"arm": arm, "params": res["params"], "dim": mcfg.dim, "vocab": len(used)}), flush=True)
        for i, ((fam, _), batch) in enumerate(zip(plan[arm], pairs[arm]), 1):
            opt.lr = a.lr * min(1.0, i / SFT_LR_WARMUP)
            t = time.time()
            losses.append(sft_batch_step(actor, [(ren(p), ren(r)) for p, r in batch], opt, eos))
            train_s += time.time() - t
            if i % a.check_every == 0 or i == len(plan[arm]):
                both = {c: [forced_hits(actor.model, *it) for it in its] for c, its in items.items()}
                hits = {c: [h[2:] for h in hs] for c, hs in both.items()}                 # the numbers
                acc = {c: sum(map(all, hs)) / len(hs) for c, hs in hits.items()}      # the worked chain, all right
                acc.update({f"{c}_lookup": sum(all(h[:LOOKUPS]) for h in hs) / len(hs) for c, hs in hits.items()})
                acc.update({f"{c}_value_tok": sum(sum(h[:LOOKUPS]) for h in hs) / (LOOKUPS * len(hs))
                            for c, hs in hits.items()})
                acc.update({f"{c}_letters": sum(all(h[:LOOKUPS]) for h in hs) / len(hs) for c, hs in both.items()})
                acc.update({f"{c}_pos": [round(sum(col) / len(col), 3) for col in zip(*hs)] for c, hs in both.items()})
                curve.append({"step": i, "family": fam, "nll": losses[-1],
                              "nll_mean": sum(losses) / len(losses), **acc, "train_s": round(train_s, 1)})
                losses = []
                print(json.dumps({"arm": arm, **curve[-1]}), flush=True)
            if train_s > a.max_seconds:
                break
        res["arms"][arm] = {"steps": i, "train_s": round(train_s, 1), "curve": curve}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def cmd_warmup(a):
    """Rollout-shaped requests at a just-started server, timed (see the module docstring): the first `prompts`
    training prompts of the task in the V4 chat format, `n` samples each."""
    from concurrent.futures import ThreadPoolExecutor
    from nanoflash.sglang.client import SGLangClient
    tok = _tokenizer()
    module, family, split = task_module(a.task)
    prompts = [tok.encode_chat(p) for p in module.problems(family, split)[:a.prompts]]
    client, t0 = SGLangClient(a.url, timeout=a.wait, retry_s=a.wait), time.time()
    client.server_info(a.url)                     # retried until the HTTP server answers
    t_up = time.time() - t0
    params = {"n": a.n, "max_new_tokens": a.new_tokens, "temperature": 1.0}
    client.generate(prompts[0], {**params, "n": 1})  # the first forward: most of the compiles
    t_first = time.time() - t0
    for _ in range(a.rounds):                     # batched prefills and decodes, as in a rollout and an eval
        with ThreadPoolExecutor(len(prompts)) as ex:
            list(ex.map(lambda p: client.generate(p, params), prompts))
    print(json.dumps({"http_up_s": round(t_up, 1), "first_generate_s": round(t_first, 1),
                      "total_s": round(time.time() - t0, 1), "requests": 1 + a.rounds * a.prompts * a.n}), flush=True)


def _tokenizer():
    from nanoflash.rl.data import V4Tokenizer
    return V4Tokenizer()


def cmd_report(a):
    from instruments import runstats
    tok = _tokenizer()
    summary = runstats.report(a.run, a.out, extra={k: p for k, p in (("sft", a.sft), ("parity", a.parity)) if p},
                              decode=lambda i: tok.decode([i]))
    print(json.dumps(summary["bars"], indent=1))


FIRST_TIMED_STEP = 2     # step 1 of a one-step-off run generates alone (nothing ran beside it)
STEP_RATIO_BAR = 0.7     # issue 41: async step time <= 0.7x sync
PASS_SE_BAR = 2.0        # issue 41: held-out pass@1 within 2 SE of the sync run at the same step


def run_summary(run_dir: str, window=None, gpu_rows=()) -> dict:
    """One compared run's numbers (see the module docstring); `window` (t0, t1) selects its gpu.csv rows."""
    from nanoflash.rl.metrics import read_jsonl
    recs = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = [r for r in recs if r["kind"] == "train"]
    if not train:
        return {"steps": 0, "error": f"no train records in {run_dir}"}
    # a step during which the server died and was restarted times the restart (tens of seconds), not the loop;
    # so does the step whose rollout it lost ("during": "rollout for step N"), regenerated with nothing beside it
    restarted = set()
    for r in recs:
        if r["kind"] == "server_restart":
            lost = re.search(r"step (\d+)", str(r.get("during", "")))
            restarted |= {r["step"], *([int(lost.group(1))] if lost else [])}
    timed = [r for r in train if r["step"] >= FIRST_TIMED_STEP and r["step"] not in restarted] or train
    mean = lambda k, rs=timed: sum(r.get(k) or 0.0 for r in rs) / len(rs)  # noqa: E731
    steps_s = sorted(r["step_s"] for r in timed)
    se_t = statistics.stdev(steps_s) / len(steps_s) ** 0.5 if len(steps_s) > 1 else None   # SE of the mean
    gen, trained = sum(r.get("samples_generated", 0) for r in train), sum(r.get("samples_trained", 0) for r in train)
    pushes = [r for r in train if r.get("sync_tensors")]
    out = {"steps": len(train), "steps_timed": len(timed), "server_restarts": len(restarted),
           "restart_steps": sorted(restarted), "step_s_mean": mean("step_s"), "step_s_se": se_t,
           "step_s_median": steps_s[len(steps_s) // 2],
           "rollout_s": mean("rollout_s"), "rollout_wait_s": mean("rollout_wait_s"),
           "boundary_wait_s": mean("boundary_wait_s"), "train_s": mean("train_s"), "sync_s": mean("sync_s"),
           "gap_mean": mean("train_rollout_logprob_abs_diff", train), "tis_mean": mean("tis", train),
           "tis_clipfrac_mean": mean("tis_clipfrac", train),
           "staleness_max": max(r.get("staleness_max", 0) for r in train),
           "staleness_mean": mean("staleness_mean", train), "samples_generated": gen, "samples_trained": trained,
           "generated_per_trained": gen / trained if trained else None, "reward_first": train[0]["reward_mean"],
           "reward_last": train[-1]["reward_mean"], "pushes": len(pushes),
           "pushes_verified": sum(bool(r.get("sync_verified")) for r in pushes),
           "gpu_peak_gib": max((r.get("gpu_peak_gib") or 0.0) for r in train),
           "evals": [{"step": r["step"], "pass@1": r["pass@1"], "se": r["pass@1_se"]}
                     for r in recs if r["kind"] == "eval"]}
    rows = [g for g in gpu_rows if window and window[0] <= g[0] <= (window[1] if len(window) > 1 else math.inf)]
    if rows:
        out.update(gpu_util_mean=sum(g[1] for g in rows) / len(rows), gpu_mem_max_mib=max(g[2] for g in rows),
                   gpu_samples=len(rows))
    return out


def _ratio_ci95(s: dict, y: dict):
    """The 95% interval of mean(async step) / mean(sync step), each mean's SE from its steps' scatter (the delta
    method: relative SEs add in quadrature); None without two timed steps a run."""
    if s.get("step_s_se") is None or y.get("step_s_se") is None:
        return None
    r = y["step_s_mean"] / s["step_s_mean"]
    se = r * ((s["step_s_se"] / s["step_s_mean"]) ** 2 + (y["step_s_se"] / y["step_s_mean"]) ** 2) ** 0.5
    return [r - 1.96 * se, r + 1.96 * se]


def cmd_compare(a):
    """compare.json of a synchronous and a one-step-off run (see the module docstring)."""
    gpu = []
    if a.gpu and os.path.exists(a.gpu):
        for line in open(a.gpu):
            parts = [x.strip() for x in line.split(",")]
            try:
                gpu.append((float(parts[0]), float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
    windows = {}
    if a.windows and os.path.exists(a.windows):
        for line in open(a.windows):
            mode, t = line.split()
            windows.setdefault(mode, []).append(float(t))
    res = {mode: run_summary(d, tuple(windows.get(mode, [])[:2]) or None, gpu)
           for mode, d in (("sync", a.sync), ("async", a.async_run))}
    s, y = res["sync"], res["async"]
    if s.get("steps") and y.get("steps"):
        ratio = y["step_s_mean"] / s["step_s_mean"]
        # a run that stopped early (a crash, the hold's end) times fewer steps: the ratio is reported, the bar is not
        complete = s["steps"] == y["steps"]
        common = sorted({e["step"] for e in s["evals"]} & {e["step"] for e in y["evals"]})
        bars = {"async_over_sync_step_s": ratio, "step_ratio_ci95": _ratio_ci95(s, y),
                "step_ratio_bar": STEP_RATIO_BAR, "step_ratio_met": ratio <= STEP_RATIO_BAR if complete else None,
                "complete": complete, "steps": {"sync": s["steps"], "async": y["steps"]},
                "pushes_all_verified": all(r["pushes"] == r["pushes_verified"] > 0 for r in (s, y))}
        if common:
            at = common[-1]
            ps, py = (next(e for e in r["evals"] if e["step"] == at) for r in (s, y))
            se = (ps["se"] ** 2 + py["se"] ** 2) ** 0.5
            bars.update(pass_step=at, pass_sync=ps["pass@1"], pass_async=py["pass@1"], pass_diff=py["pass@1"] - ps["pass@1"],
                        pass_diff_se=se, pass_within_2se=abs(py["pass@1"] - ps["pass@1"]) <= PASS_SE_BAR * se)
        res["bars"] = bars
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res.get("bars", res), indent=1))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("phase", choices=["sft", "calibrate", "calibrate_long", "report", "warmup", "compare"])
    ap.add_argument("--out", default="/tmp/warm")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--target", type=float, default=0.6, help="phase 1 ends when validation pass@1 reaches this")
    ap.add_argument("--glance-share", type=float, default=0.15, help="phase 2: share of worked demonstrations")
    ap.add_argument("--worked-max", type=float, default=0.6, help="phase 2 ends when P(worked) is at most this: at "
                    "0.3, runs 4 and 5 landed at P 0.085 / 0.175 (each step past the mark), held-out pass@1 0.094 / "
                    "0.088, with worked chains right at most 0.42 of the time after phase 2 (run 5); 0.6 aims at "
                    "~0.15-0.2 (experiments/h200/README.md, run 5)")
    ap.add_argument("--glance-steps", type=int, default=60, help="phase 2: at most this many steps")
    ap.add_argument("--glance-seconds", type=float, default=0.0, help="phase 2: at most this long (0: no limit; "
                    "the long run's glance checks 32 long prompts a step, ~2.4 s a step in its first hold)")
    ap.add_argument("--glance-lr", type=float, default=3e-5, help="phase 2's learning rate, cut near the mark by "
                    "glance.run: at 1e-4 (run 4) P(worked) went 0.99 -> 0.47 -> 0.085 in two steps, at 3e-5 (the "
                    "second long hold) 0.99 -> 0.70 -> 0.06, past --worked-max")
    ap.add_argument("--worked-target", type=float, default=0.25, help="phase 2: where the step rates aim P(worked) "
                    "(glance.py), below --worked-max")
    ap.add_argument("--sft-data", default="", help="the SFT's problems (py:experiments.h200.<module>:<family>:"
                    "train), if not the recipe's train.data (the long run: longctx factssft, short-heavy)")
    ap.add_argument("--val-data", default="", help="the validation problems' family (its val split is read)")
    ap.add_argument("--val", default="sample", choices=["sample", "forced"],
                    help="stopping rule's pass@1: sampled in-process (sums) or teacher-forced (long prompts)")
    ap.add_argument("--check-every", type=int, default=CHECK_EVERY, help="SFT steps between validation checks")
    ap.add_argument("--val-problems", type=int, default=VAL_PROBLEMS, help="validation problems per check")
    ap.add_argument("--curriculum", default="", help="phase 1 as a schedule of families, e.g. "
                    "factsnear:look=0.9:s=180,factsmid:look=0.6:s=90,factssft (experiments/h200/curriculum.py);"
                    " --sft-data names the module, --max-seconds caps the whole schedule")
    ap.add_argument("--arms", default="mix,curriculum", help="calibrate_long: which arms (mix, curriculum)")
    ap.add_argument("--near-share", type=float, default=0.4, help="calibrate_long: the curriculum arm's share of "
                    "steps on factsnear (1.0 with --arms curriculum: near only)")
    ap.add_argument("--mix-family", default="factsmid", help="calibrate_long: the mix both arms end on")
    ap.add_argument("--task", default="py:experiments.h200.synth:sum4:train", help="warmup: whose prompts")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--run", default="runs/h200")
    ap.add_argument("--sft", default="", help="sft.json of the warm start (report)")
    ap.add_argument("--parity", default="", help="parity.json of experiments/h200/sglang_check.py (report)")
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="the server to warm up")
    ap.add_argument("--wait", type=float, default=900.0, help="seconds a warm-up request may take (compiles)")
    ap.add_argument("--prompts", type=int, default=16, help="warm-up prompts at once (n samples each)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sync", default="", help="compare: the synchronous run's directory")
    ap.add_argument("--async", dest="async_run", default="", help="compare: the one-step-off run's directory")
    ap.add_argument("--gpu", default="", help="compare: gpu.csv (time, utilisation %%, memory MiB) of the runs")
    ap.add_argument("--windows", default="", help="compare: windows.txt (mode, start / end time) of the runs")
    a, overrides = ap.parse_known_args(argv)
    if a.phase == "sft":
        cmd_sft(a, overrides)
    elif a.phase == "warmup":
        cmd_warmup(a)
    elif a.phase == "calibrate":
        cmd_calibrate(a, overrides)
    elif a.phase == "calibrate_long":
        cmd_calibrate_long(a, overrides)
    elif a.phase == "compare":
        cmd_compare(a)
    else:
        cmd_report(a)


if __name__ == "__main__":
    main()

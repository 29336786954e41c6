"""Routing replay (R3) in FP8 rollout mode: how many routing choices differ, and what replay does to |dlogp|.

    python bench/measure_r3.py [--any.override value ...]      (~15 s on 2 cores)

Recipe `demo` warm-up (50 SFT steps), then one embedded FP8 server, one rollout of 32 prompts x 8 samples
with `return_routed_experts` (dynamic sampling off), and the trainer's fp32 recompute of the same tokens
with and without replaying the engine's experts. Prints the number of (position, score-routed layer) choices
where the trainer's own top-k differs from the engine's record, and the Miles mismatch metrics both ways.
"""
import sys, torch
from nanoflash.cli import parse_args
from nanoflash.rl import collector, trainer
from nanoflash import grpo
from nanoflash.config import preset
from nanoflash.parallel.dims import ParallelDims
torch.set_num_threads(1)
cfg = parse_args(["--recipe", "demo", "--rollout.routing_replay", "true", "--grpo.n_prompts", "32",
                  "--grpo.over_sampling_batch_size", "32", "--grpo.dynamic_sampling", "false"] + sys.argv[1:])
tc, oc, par, ec, gc, rc = cfg.train, cfg.optim, cfg.parallel, cfg.eval, cfg.grpo, cfg.rollout
dims = ParallelDims()
mcfg = preset("tiny", **cfg.model)
actor = trainer.Trainer(cfg, mcfg, dims)
model = actor.model
task = collector.make_task(tc, ec, mcfg.vocab_size)
opt = trainer.make_optimizer(model, oc, lr=tc.warmup_lr)
for i in range(tc.warmup_steps):
    actor.sft_step([task.train[(i*64+j) % len(task.train)] for j in range(64)], task, opt)
client, engines, httpds = collector.start_embedded(model, 1, rc.weights, tc.seed)
collector.push(client, model, rc, 1, "/tmp/r3sync")
kept, seen, pos, _ = collector.collect(client, task, 0, gc, rc, tc.seed, mcfg)
batch = grpo.pack(seen, torch.zeros(len(seen)), 0)
res = {}
for replay in (False, True):
    actor.replay = replay
    old = actor.logprobs(batch)
    res[replay] = grpo.logprob_mismatch_metrics(old, batch.rollout_logprobs, batch.mask)
flips = tot = 0
with torch.no_grad():
    for e in seen:
        ids = torch.tensor(e.prompt_ids + e.response_ids)[None, :-1]
        model(ids)
        for k in sorted(model.layers, key=int):
            g = model.layers[k].ffn.gate
            if g.hash:
                continue
            mine = model.layers[k].ffn.last_indices.sort(-1).values
            theirs = e.routed_experts[:, int(k)].sort(-1).values
            flips += int((mine != theirs).any(-1).sum()); tot += mine.shape[0]
print(f"samples {len(seen)}, score-routed (position, layer) pairs {tot}, routes differing trainer vs FP8 engine: {flips}")
for replay, m in res.items():
    print(f"replay={replay}: " + " ".join(f"{k}={float(v):.3e}" for k, v in m.items()))
for h in httpds: h.shutdown()

"""The rollout half of the GRPO loop: tasks, embedded servers, dynamic sampling into a packed batch, R3, eval.

One rollout step (`next_batch` -> `rounds.collect`), as Miles' `inference_rollout_train` does it:

    repeat until G groups are kept (or `max_rounds`):
        take k = prompts_to_request(kept, G, carried, chunk) prompts from the data stream (position p advances)
        POST /generate {input_ids, sampling_params: {n, temperature, top_p, max_new_tokens, stop_token_ids,
                        sampling_seed = seed(run, p)}, return_logprob}      one request per prompt, all at once
        reward every sample; keep the groups whose rewards are not all equal (`grpo.filter_groups`)
    once G groups are kept, the rest is aborted on the servers (the tail), and discarded or carried
    (`rollout.partial`) -- `rounds.py` has the details

How many requests are in flight: `rollout.max_workers`, or (0) every request of a round up to what the
servers report they run (`SGLangClient.capacity`: /server_info's max running requests x DP ranks), read
once when the collector starts.

The per-request sampling seed depends only on the run seed and the prompt's position in the data stream, so
a run that resumes from a checkpoint re-draws exactly the samples the crashed run would have drawn; what a
checkpoint must add to the data position is the carried groups (`state_dict`).

Routing replay (R3): with `rollout.routing_replay` every request asks for `return_routed_experts`; SGLang
and the embedded server answer, per input position and MoE layer, the top-k experts the engine routed to
(base64 int32 [P + R - 1, n_layers, K]), which the episode carries to the trainer (`Episode.routed_experts`).

Evaluation (`Collector.eval_generate`) samples the weights the rollout servers hold, n per held-out prompt, with
the per-prompt seeds of `eval_seeds`, on one of two paths (`eval.path`): through the servers (`sample_servers`:
the rollout client, one /generate per prompt, the servers' KV caches; SGLang and at scale), or, for embedded
servers on one machine, in-process on the first engine's model (`sample_batched`: forwards batched over all
prompts of one length, no HTTP, which costs >= 0.2 s a request on the 2-core CPU demo). Both draw prompt i's
samples with the engine's sampler (`server.engine.sample`) from a generator seeded seeds[i], so on the same
weights they give the same samples and the same pass@k (`tests/test_eval_servers.py`).

Tests: `pytest tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

import copy
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nanoflash.rl import data, plugins, rewards
from nanoflash.rl.metrics import progress, step_metrics
from nanoflash.rl.rewards import VerifierUnavailable
from nanoflash.rl.rounds import (INTERRUPT_ABORT_S, SEED_MOD, Carry, RolloutCancelled, RoundStats,  # noqa: F401
                                 StaleServerError, _episodes, check_versions, collect, expert_id_dtype,
                                 request_pool, request_seed, reward_counts, round_line)
from nanoflash import grpo
from nanoflash.sglang.client import Generation, RequestRejected, ServerGoneError, SGLangClient
from nanoflash.sglang.preflight import ServerMismatch, check_servers
from nanoflash.server.engine import RolloutEngine, sample
from nanoflash.server.http import serve

# single-digit arithmetic has only 200 expressions: hold out a quarter (57) so the eval is not 24 problems
ARITH_HELDOUT_PERCENT = {1: 25}
MAX_ARITH_TRAIN = 50_000  # cap on the training pool of the larger difficulties


@dataclass
class Task:
    """What the loop needs to know about a task: prompts, held-out problems, token <-> text, reward."""

    train: list                     # training problems, in the fixed shuffled order of the data stream
    heldout: list                   # evaluation problems
    encode: Callable                # Problem -> prompt ids
    decode: Callable                # response ids -> text
    reward: Callable                # (problems, response id lists) -> rewards
    stop_ids: list                  # ids that end a response
    pad_id: int
    warmup: list | None = None      # problems of the supervised warm-up (make_task: `train.warmup_data`, else train)
    chance: float | None = None     # P(a sample is right) when answering at random, if the task has one (plots)


def arith_answer(tc, spec: str | None = None, field: str = "train.data") -> str:
    """The arithmetic family of a task=arith run: `train.data` = "arith:<answer>" (data.ARITH_ANSWERS), else
    "value" (the file path of task=dapo means nothing to the synthetic task)."""
    spec = tc.data if spec is None else spec
    if not spec.startswith("arith:"):
        return "value"
    answer = spec.partition(":")[2]
    if answer not in data.ARITH_ANSWERS:
        raise ValueError(f"{field}={spec!r}: the arithmetic family must be one of "
                         f"{['arith:' + a for a in data.ARITH_ANSWERS]}")
    return answer


def make_task(tc, ec, vocab_size: int, rewards_here: bool = True) -> Task:
    """arith: synthetic `a+b=` problems with CharTokenizer (`train.data=arith:mod10`: the last-digit family of
    the CPU demo); dapo: DAPO-Math-17K (DAPO instruction re-added) + AIME with the V4 tokenizer; chat: any
    jsonl / parquet of prompt-answer rows, prompts as they are. `train.reward=module:function` replaces the
    task's reward by a plug-in (`plugins.PluginReward`: the contract, timeouts and errors).
    `rewards_here=False` (every rank but 0, which alone scores): the reward's worker processes (math-verify,
    a plug-in's) are not started; its imports are still checked."""
    task = _arith_task(tc, ec, vocab_size) if tc.task == "arith" else _chat_task(tc, ec, vocab_size, rewards_here)
    if tc.warmup_data and (tc.task != "arith" or not tc.warmup_data.startswith("arith:")):
        raise ValueError(f"train.warmup_data={tc.warmup_data!r}: a warm-up set is an arithmetic family, "
                         f"arith:<answer> ({', '.join(data.ARITH_ANSWERS)}), with train.task=arith")
    task.warmup = arith_family(tc, tc.warmup_data, "train.warmup_data")[0] if tc.warmup_data else task.train
    if tc.reward:
        plugin = plugins.PluginReward(tc.reward, n_workers=tc.reward_workers, timeout_s=tc.reward_timeout_s,
                                      start=rewards_here)
        task.reward = plugins.token_plugin_fn(task.decode, plugin)
        task.chance = None   # what a random answer scores under someone else's reward: unknown
    return task


def _arith_task(tc, ec, vocab_size: int) -> Task:
    """task=arith: the synthetic family of `train.data` (arith:mod10 / value), hash-split train / held out."""
    tok = data.CharTokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(f"train.task=arith: the arithmetic tokenizer needs {tok.vocab_size} ids but the "
                         f"model's vocab_size is {vocab_size}; set --model.vocab_size {tok.vocab_size}")
    train, heldout = arith_family(tc, tc.data, "train.data", ec.n_problems)
    chance = 0.1 if arith_answer(tc) in data.LAST_DIGIT else None   # one digit of ten
    return Task(train, heldout, tok.encode_prompt, tok.decode,
                rewards.token_reward_fn(tok.decode, rewards.arith_reward, tok.vocab_size), [tok.eos_id], tok.pad_id,
                chance=chance)


def arith_family(tc, spec: str, field: str, n_heldout: int = 0) -> tuple[list, list]:
    """(every training expression in the run's shuffled order, the first n_heldout held-out ones) of the family
    "arith:<answer>" at `train.difficulty`; the split is data.arith_heldout, the same for every family."""
    answer = arith_answer(tc, spec, field)
    pct = ARITH_HELDOUT_PERCENT.get(tc.difficulty, 10) if answer == "value" else 10
    n_train, n_held = _arith_split_sizes(tc.difficulty, pct, answer)
    kw = dict(difficulty=tc.difficulty, seed=0, heldout_percent=pct, answer=answer)
    train = data.arithmetic_problems(n_train, "train", **kw)
    random.Random(tc.seed).shuffle(train)
    return train, data.arithmetic_problems(min(n_heldout, n_held), "heldout", **kw) if n_heldout else []


def _chat_task(tc, ec, vocab_size: int, rewards_here: bool = True) -> Task:
    """task=dapo|chat: the V4 tokenizer and chat format; the model's vocabulary must hold its ids."""
    tok = data.V4Tokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(f"train.task={tc.task}: the DeepSeek-V4 tokenizer has {tok.vocab_size:,} ids but the model's "
                         f"vocab_size is {vocab_size}; use --preset small or flash (or --model.vocab_size "
                         f"{tok.vocab_size})")
    train, skipped = data.load_problems(tc.data, tc.task, tc.task == "dapo", tc.prompt_key, tc.answer_key, "train")
    heldout = data.load_problems(ec.data, None, False, ec.prompt_key, ec.answer_key, "eval")[0] if ec.every else []
    print(f"task {tc.task}: {len(train)} training problems ({skipped} rows skipped), {len(heldout)} eval problems")
    random.Random(tc.seed).shuffle(train)
    eos, decode = tok.token_id(data.EOS), lambda ids: tok.decode(ids, True)
    reward = None if tc.reward else rewards.token_reward_fn(decode, rewards.MathReward(start=rewards_here),
                                                                tok.vocab_size)  # or plug-in
    return Task(train, heldout[:ec.n_problems], tok.encode_chat, decode, reward, [eos], eos)


def _arith_split_sizes(difficulty: int, pct: int, answer: str = "value") -> tuple[int, int]:
    """(train, held-out) expression counts of one difficulty and family; enumerated when small, else capped."""
    if difficulty > (2 if answer == "value" else 5):
        return MAX_ARITH_TRAIN, 10 ** 6
    ops, hi = "+" if answer in data.LAST_DIGIT else "+-", 10 ** difficulty
    bs = {"mod10": range(1, data.MOD10_MAX_ADDEND + 1), "copy": [0]}.get(answer, range(hi))
    held = sum(data.arith_heldout(a, op, b, difficulty, answer, pct) for a in range(hi) for b in bs for op in ops)
    return min(len(ops) * hi * len(bs) - held, MAX_ARITH_TRAIN), held


# ---------------------------------------------------------------------------------------------- servers
def start_embedded(model, n: int, weights: str, seed: int, api_key: str | None = None, **server_kw):
    """Start `n` embedded SGLang-protocol servers on copies of `model`; returns (client, engines, httpds).
    `server_kw`: server.serve's disk_root, group_hosts, limits."""
    engines, httpds, urls = [], [], []
    for i in range(n):
        m = copy.deepcopy(model).float()
        if weights == "bf16":
            m.cast_(torch.bfloat16)
        engine = RolloutEngine(m, weights=weights, seed=seed + i)
        httpd, url = serve(engine, api_key=api_key, **server_kw)
        engines.append(engine)
        httpds.append(httpd)
        urls.append(url)
    client = SGLangClient(urls, api_key=api_key)
    client.wait_healthy()
    return client, engines, httpds


def wait_for_servers(client, timeout_s: float) -> None:
    """Block until every external server answers /health; after `timeout_s` stop with one line naming them."""
    try:
        client.wait_healthy(timeout=timeout_s)
    except ServerGoneError as e:
        raise SystemExit(f"rollout.urls: {e} (rollout.health_timeout_s={timeout_s:g}; is SGLang still "
                         f"loading?)") from None


def preflight(client, rc, mcfg=None) -> None:
    """The servers at rollout.urls hold experts as the push sends them, for a distributed push run the
    trainer's torch (and NCCL), and for indexer replay send records the trainer can replay (probed with the
    model's config `mcfg`): `sglang.preflight`; else one line, stop, before the first push."""
    try:
        for note in check_servers(client, rc.weights, rc.transport == "distributed",
                                  indexer_replay=rc.indexer_replay, mcfg=mcfg):
            print(f"rollout.urls: {note}", flush=True)
    except ServerMismatch as e:
        raise SystemExit(f"rollout.urls: {e}") from None


class Collector:
    """The rollout half of the loop, on rank 0: the client, the servers (embedded ones it starts itself, or
    SGLang at `rollout.urls`), the task and the data position.

        collector.next_batch(step) -> (packed grpo.RolloutBatch | None, metrics)   the data position advances
        collector.eval_generate(prompts, n, seeds) -> samples of the weights the servers hold
        collector.served = step       after every push: the weights the servers hold (samples' versions)
        collector.cancel.set()        stops a rollout running in another thread (`schedule.OneStepOff`)

    `model` (the full weights for the embedded servers' first copy) is only read when no URLs are given.
    `pos` is the data position (a checkpoint's `data_pos`); `carry` the groups carried to the next step
    (rollout.partial); `capacity` the sequences the servers run at once, as they report it (None: they do not
    say).
    """

    def __init__(self, cfg, task: Task, mcfg, model, pos: int = 0):
        self.cfg, self.task, self.mcfg, rc = cfg, task, mcfg, cfg.rollout
        self.pos, self.served, self.carry, self.cancel = pos, None, Carry(), threading.Event()
        self.history = (0, 0)   # (groups kept, groups rewarded) of the last step: grpo.adaptive_over_sampling
        if rc.urls:
            self.client, self.engines, self.httpds = SGLangClient(list(rc.urls), api_key=rc.key(),
                                                                  retry_s=rc.retry_s,
                                                                  update_timeout=rc.update_timeout_s), [], []
            wait_for_servers(self.client, rc.health_timeout_s)  # a cold SGLang start outlasts the client's retries
            preflight(self.client, rc, mcfg)
        else:  # disk pushes land below the run directory; groups: the sync host (any, if not loopback)
            host = rc.sync_addr.rpartition(":")[0]
            self.client, self.engines, self.httpds = start_embedded(
                model, rc.n_servers, rc.weights, cfg.train.seed, rc.key(), disk_root=cfg.train.out_dir,
                group_hosts=None if host in ("127.0.0.1", "localhost") else ("*",))
        self.capacity = None if rc.max_workers else self.client.capacity()
        if not rc.max_workers:
            print(f"rollout: {concurrency_line(self.capacity, cfg.grpo.group_size)}", flush=True)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollout side beyond the data position: the carried groups and the last
        step's keep rate (adaptive over-sampling sizes the next round from it)."""
        return {"carry": self.carry.state_dict(), "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.carry.load_state_dict(state["carry"])
        self.history = tuple(state["history"])

    def next_batch(self, at: int) -> tuple:
        """Dynamic-sampling rollout for step `at` -> advantages -> the packed global batch and its metrics.
        The data position advances only when it succeeds: a server that died (`ServerGoneError`) or lost the
        weights (`StaleServerError`) raises, and the loop's restart policy (`rl/restarts.py`) redoes the step
        from the same position. A rejected request or a reward verifier that cannot start: one line, stop."""
        tc, gc = self.cfg.train, self.cfg.grpo
        t0, bar = time.time(), progress(gc.n_prompts, f"rollout {at}/{tc.steps}", tc.progress)
        on_round = lambda r: bar.write(round_line(r, f"rollout {at}/{tc.steps}", self.cfg))  # noqa: E731
        try:
            kept, seen, pos, counts = collect(self.client, self.task, self.pos, self.cfg, self.mcfg, bar, on_round,
                                              self.carry, at, self.served, self.capacity, self.cancel, self.history)
        except (RequestRejected, VerifierUnavailable) as e:
            raise SystemExit(f"rollout for step {at} failed: {e}") from None
        finally:
            bar.close()   # a Ctrl-C's line must not land on a half-drawn bar
        self.pos, t_roll, self.history = pos, time.time() - t0, (counts["groups_kept"], counts["groups_seen"])
        m = {**step_metrics(seen, gc.group_size), **counts, "rollout_s": t_roll,
             "rollout_tokens_per_s": sum(len(e.response_ids) for e in seen) / t_roll}
        if not kept:
            return None, m
        adv = grpo.episode_advantages(kept, gc.group_size, eps=gc.adv_eps, std_normalize=gc.std_normalize)
        return grpo.pack(kept, adv, self.task.pad_id), m

    def eval_generate(self, prompts: list, n: int, seeds: list) -> list:
        """n samples per prompt from the weights the servers hold -> per prompt [(ids, finish_reason)] * n.
        eval.path: "batched" = in-process on the first embedded engine's model, forwards batched over prompts
        (one machine, the CPU demo); "servers" = one /generate per prompt through the rollout client (SGLang,
        at scale); "auto" = batched when the servers are embedded. Same seeds -> the same samples."""
        ec = self.cfg.eval
        path = ec.path if ec.path != "auto" else ("batched" if self.engines else "servers")
        if path == "batched":
            if not self.engines:
                raise ValueError("eval.path=batched samples an embedded engine in-process; with rollout.urls "
                                 "use eval.path=servers (or auto)")
            engine = self.engines[0]
            with engine.lock:  # no weight update while it samples
                check_versions([Generation([], [], [], "", engine.weight_version, self.client.urls[0])],
                               self.client.weight_version)  # as its server reports it (a restart resets it)
                return sample_batched(engine.model, prompts, n, ec.max_new_tokens, ec.temperature,
                                      list(self.task.stop_ids), seeds, top_p=ec.top_p)
        sp = {"n": n, "temperature": ec.temperature, "top_p": ec.top_p, "max_new_tokens": ec.max_new_tokens,
              "stop_token_ids": list(self.task.stop_ids)}
        workers = self.cfg.rollout.max_workers or (max(1, self.capacity // n) if self.capacity else len(prompts))
        return sample_servers(self.client, prompts, sp, seeds, workers, check=True)

    def close(self) -> None:
        for httpd in self.httpds:
            httpd.shutdown()


def concurrency_line(capacity: int | None, n: int) -> str:
    """How many requests a round keeps in flight, and why (rollout.max_workers=0)."""
    if capacity is None:
        return ("the servers report no capacity (/server_info has no max running requests): every request of a "
                "round is sent at once (rollout.max_workers bounds it)")
    return (f"the servers run {capacity} sequences at once (/server_info): up to {max(1, capacity // n)} requests "
            f"of {n} samples in flight (rollout.max_workers overrides)")


# ---------------------------------------------------------------------------------------------- eval
def eval_seeds(run_seed: int, at: int, n_prompts: int) -> list:
    """Sampling seed of held-out prompt i at the eval of step `at`: the same on both eval paths."""
    base = request_seed(run_seed + 1, at)
    return [request_seed(base, i) for i in range(n_prompts)]


@torch.no_grad()
def sample_batched(model, prompts: list, n: int, max_new: int, temperature: float, stop_ids: list, seeds: list,
                   top_p: float = 1.0, rows_per_forward: int = 1024) -> list:
    """n samples per prompt, the forwards batched over prompts of equal length; prompt i draws from its own
    generator seeded seeds[i], one `sample` call per step on its n rows -- the embedded engine's draws for a
    request with sampling_seed seeds[i]. -> per prompt [(ids, finish_reason)] * n"""
    if len(seeds) != len(prompts):
        raise ValueError(f"sample_batched: {len(seeds)} seeds for {len(prompts)} prompts")
    dev = next(model.parameters()).device
    out: list = [None] * len(prompts)
    by_len: dict = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    stops = torch.tensor(stop_ids, device=dev)
    for L, idx in sorted(by_len.items()):
        gens = [torch.Generator(device=dev).manual_seed(seeds[i]) for i in idx]
        seqs = torch.tensor([prompts[i] for i in idx for _ in range(n)], device=dev)  # [R,L], R = len(idx) n
        done = torch.zeros(len(seqs), dtype=torch.bool, device=dev)
        for _ in range(max_new):
            logits = torch.cat([model(seqs[a:a + rows_per_forward])[:, -1]
                                for a in range(0, len(seqs), rows_per_forward)])      # [R,V]
            nxt = torch.cat([sample(logits[j * n:(j + 1) * n], temperature, top_p, -1, g)
                             for j, g in enumerate(gens)])                            # [R]
            nxt = torch.where(done, stops[0], nxt)
            seqs = torch.cat([seqs, nxt[:, None]], 1)                                 # [R,L+1]
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
        for j, i in enumerate(idx):
            group = []
            for row in seqs[j * n:(j + 1) * n, L:].tolist():
                hit = next((t for t, tok in enumerate(row) if tok in stop_ids), None)
                group.append((row[:hit + 1], "stop") if hit is not None else (row, "length"))
            out[i] = group
    return out


def sample_servers(client, prompts: list, sp: dict, seeds: list, max_workers: int, check: bool = False) -> list:
    """One /generate request per prompt (n = sp["n"] samples, sampling_seed seeds[i]) through the rollout
    client, spread over its servers, their KV caches doing the decoding. -> per prompt [(ids, reason)] * n.
    `check`: every sample must come from the last verified push (`check_versions`, as the rollout's): a server
    restarted since would be scored on its initial weights."""
    if len(seeds) != len(prompts):
        raise ValueError(f"sample_servers: {len(seeds)} seeds for {len(prompts)} prompts")
    with request_pool(client, max_workers) as pool:
        futs = [pool.submit(client.generate, ids, {**sp, "sampling_seed": s}, return_logprob=False)
                for ids, s in zip(prompts, seeds)]
        gens = [f.result() for f in futs]
    out = []
    for i, group in enumerate(gens):
        if check:
            check_versions(group, getattr(client, "weight_version", None))
        bad = [g.finish_reason for g in group if g.finish_reason not in ("stop", "length")]
        if bad or len(group) != sp["n"]:
            raise ValueError(f"eval prompt {i}: {group[0].server if group else 'a server'} returned "
                             f"{len(group)} samples (n={sp['n']}), finish reasons {bad or 'ok'}")
        out.append([(g.output_ids, g.finish_reason) for g in group])
    return out

"""One rollout step's dynamic-sampling rounds: every request of a round in flight, the tail aborted once the
step has its groups, partial samples discarded or carried into the next step.

    repeat until G groups are kept (or `rollout.max_rounds`):
        groups = the carried ones (partial rollouts, oldest first) + k new prompts from the data stream,
                 k = prompts_to_request(kept, G, carried, grpo.over_sampling_batch_size)
        send every request of the round at once (at most `inflight`: what the servers say they run)
            a new group:      POST /generate {input_ids: prompt, n, sampling_seed = seed(run, position)}
            a carried sample: POST /generate {input_ids: prompt + its tokens, n: 1,
                                              max_new_tokens: what is left, sampling_seed = seed(run, position,
                                              sample, part)}
        take the results in submission order: a group whose samples all finished is rewarded, then kept or
        dropped (dynamic sampling: rewards all equal)
        the G-th kept group closes the step: the requests not yet sent are never sent, the running ones are
        aborted on every server (POST /abort_request {"abort_all": true}; what each returns is what it had)

The tail, once the step is closed (Miles `sglang_rollout.abort`, radixark/miles@31f1ca96): without
`rollout.partial` every group not yet taken is discarded (its prompt is consumed, as Miles discards it); with
it (Miles `--partial-rollout`) every such group goes into the carry buffer `Carry` and is continued in the
next step's first round under whatever weights the servers hold then: samples that finished stay as they are,
unfinished ones resume from their last token (Miles `generate`: `input_ids = sample.tokens`, `max_new_tokens
-= response length`). A token keeps the log-prob of the policy that sampled it, so the trainer's TIS weight
exp(old - rollout) corrects the older ones (`grpo.use_tis`).

Why results are taken in submission order (Miles takes them as they complete): the kept set is then the
first G informative groups of the data stream whatever the timing, so a run and its resume keep the same
groups, and short responses are not favoured (the first groups to complete are the short ones).

Weight versions and staleness: every segment of tokens records the step whose weights sampled it (`version`,
the step last pushed: the loop moves it only between rollouts, so it never changes during one). A sample
trained at step `at` (whose update starts from the weights of step at - 1) has staleness (at - 1) - its
oldest version: 0 in the synchronous loop, 1 one step off, more for carried tokens. A carried group whose
staleness would exceed `rollout.max_staleness` is dropped before it is continued.

What each step logs (`collect`'s counters): samples_generated (samples that finished, used or not) and
samples_trained, so generated_per_trained; samples_aborted (returned partial by the tail abort),
tokens_generated / tokens_trained; carried groups, their share of the trained tokens (partial_token_share);
staleness (mean, max, and the count of trained samples per value: staleness_0, staleness_1, ...); and
trained_groups, the data positions of the groups trained (what the kill -9 and resume test counts).

Tests: `pytest tests/test_rollout_tail.py -q`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanoflash import grpo
from nanoflash.sglang.client import RequestRejected, decode_routed_experts
from nanoflash.sglang.preflight import indexer_record

SEED_MOD = 2 ** 62  # SGLang sampling seeds are int64; keep them positive
# Ctrl-C: each server gets this long to take `/abort_request {"abort_all"}`; a healthy one answers at once, and a
# second Ctrl-C does not wait for the rest (train.py)
INTERRUPT_ABORT_S = 2.0
# Threads one round may hold: each /generate request is a thread blocked on its socket. Above this a round's
# requests queue in the pool (the flash recipe's rounds are 512 requests; one SGLang server runs ~2K sequences).
MAX_INFLIGHT_REQUESTS = 1024
FINISHED = ("stop", "length")
# The tail: a request still running this long after `abort_all` was sent after it (it reached its server after
# the abort): the abort is sent again. SGLang ends an aborted request after one more decode step.
ABORT_REPEAT_S = 1.0


class StaleServerError(RuntimeError):
    """A server answered with weights other than the last verified push (it restarted, or missed a push)."""


class RolloutCancelled(RuntimeError):
    """The loop cancelled the rollout (Ctrl-C while it ran in the background)."""


def request_seed(run_seed: int, position: int) -> int:
    """Sampling seed of the request for the prompt at `position` of the data stream (resume-stable)."""
    return (run_seed * 1_000_003 + position * 7_919 + 17) % SEED_MOD


def continuation_seed(run_seed: int, position: int, sample: int, part: int) -> int:
    """Sampling seed of part `part` (1, 2, ...) of sample `sample` of the group at `position`: a carried sample
    draws its continuation from its own stream, the same on every run that carries it at that point."""
    return request_seed(run_seed + 7 * part, position * 257 + sample + 1)


def check_versions(gens, expected) -> None:
    """Every sample must come from the weight version the trainer last pushed and verified (`client.weight_version`;
    None before the first push). A server that reports another one restarted or missed a push: its samples are
    refused, naming it. Servers that report no version (older protocols) are not checked."""
    for g in gens:
        if expected is not None and g.weight_version is not None and str(g.weight_version) != str(expected):
            raise StaleServerError(f"{g.server} generated with weight version {g.weight_version}, but version "
                                   f"{expected} was pushed and verified: the server restarted or missed a push; "
                                   f"its samples are refused (rollout.max_server_restarts > 0 re-pushes into it and "
                                   f"redoes the step; or resume the run)")


def reward_counts(task) -> dict:
    """The task reward's cumulative counters (rewards.TokenReward.counts: oov, no_answer, verify_error, ...)."""
    return dict(getattr(task.reward, "counts", None) or {})


expert_id_dtype = grpo.expert_id_dtype  # R3 records in the smallest integer type of the expert count


def _episodes(gens, prompt_ids, position, task, problem, mcfg, indexed: bool = False) -> list:
    """Finished generations of one prompt -> rewarded episodes (the R3 record of each, compacted; with
    `indexed` the indexer record of each, which the server must have sent)."""
    rs = task.reward([problem] * len(gens), [g.output_ids for g in gens])
    out = []
    for g, r in zip(gens, rs):
        rx = kx = None
        if "routed_experts" in g.meta_info:  # R3: the experts the engine chose, per input position and layer
            rx = decode_routed_experts(g.meta_info, mcfg.n_layers, mcfg.n_activated_experts).to(
                expert_id_dtype(mcfg.n_routed_experts))
        if indexed:                          # indexer replay: the C4 entries it kept, per input position and layer
            kx = grpo.entry_record(indexer_record(g.meta_info, len(prompt_ids) + len(g.output_ids) - 1, mcfg))
        out.append(grpo.Episode(prompt_ids, g.output_ids, g.logprobs, float(r), position, g.finish_reason or "stop",
                                rx, kx))
    return out


@contextlib.contextmanager
def request_pool(client, max_workers: int):
    """A thread pool for /generate requests that never outlives what stops its caller: on an error the queued
    requests are cancelled (never sent) and the running ones finish; on Ctrl-C (KeyboardInterrupt) the running
    ones are aborted on every server too (`client.abort_all`, best effort) and not waited for."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, MAX_INFLIGHT_REQUESTS)))
    try:
        yield pool
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        abort_all(client, INTERRUPT_ABORT_S)
        raise
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def abort_all(client, timeout: float | None = None) -> None:
    """`POST /abort_request {"abort_all": true}` on every server, best effort (a client without it: nothing)."""
    fn = getattr(client, "abort_all", None)
    if fn is not None:
        fn(**({} if timeout is None else {"timeout": timeout}))


def inflight_requests(rc, capacity: int | None, group_size: int) -> int | None:
    """Requests one round keeps in flight: `rollout.max_workers` when set, else the servers' capacity in
    sequences (`SGLangClient.capacity`: max running requests x DP ranks, summed) over the n sequences a request
    holds; None (every request of the round) when neither is known."""
    if rc.max_workers:
        return rc.max_workers
    return max(1, capacity // group_size) if capacity else None


# ---------------------------------------------------------------------------------------------- carried state
@dataclass
class Sample:
    """One sample of a group, finished or not: its tokens so far, their log-probs, and which weights sampled
    which tokens (`segments`: [version, tokens, step of the rollout] in order; version None when unknown)."""

    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    finish: str | None = None       # "stop" | "length" once finished; None while partial
    meta: dict = field(default_factory=dict)   # the last answer's meta_info (its R3 record covers every token)
    parts: int = 0                  # requests that contributed tokens (1 = never carried)

    def add(self, g, version, at) -> None:
        """Append one answer (a client.Generation) of this sample, sampled by the weights of step `version`
        in the rollout of step `at`."""
        self.ids += g.output_ids
        self.logprobs += g.logprobs
        if g.output_ids:
            self.segments.append([version, len(g.output_ids), at])
        if g.output_ids or not self.meta:   # an empty answer (aborted in a queue) keeps the R3 record it had
            self.meta = dict(g.meta_info or {})
        self.parts += 1
        reason = g.finish_reason or "stop"
        self.finish = reason if reason in FINISHED else None

    def tokens_before(self, at) -> int:
        """Tokens sampled in the rollouts of steps before `at` (carried tokens)."""
        return sum(k for _, k, a in self.segments if a != at)

    def oldest(self):
        versions = [v for v, k, _ in self.segments if k and v is not None]
        return min(versions) if versions else None


@dataclass
class Group:
    """One prompt's n samples in the making (its `position` in the data stream is its group id)."""

    position: int
    samples: list = field(default_factory=list)   # [] until its first answer

    @property
    def done(self) -> bool:
        return bool(self.samples) and all(s.finish for s in self.samples)

    def oldest(self):
        versions = [v for v in (s.oldest() for s in self.samples) if v is not None]
        return min(versions) if versions else None


class Carry:
    """The groups a closed step left unfinished (partial rollouts), continued first by the next step; what a
    checkpoint stores of them (`state_dict` / `load_state_dict`: lists, ints, floats and strings only)."""

    def __init__(self):
        self.groups: list[Group] = []

    def __len__(self) -> int:
        return len(self.groups)

    def state_dict(self) -> dict:
        return {"groups": [{"position": g.position,
                            "samples": [{"ids": s.ids, "logprobs": s.logprobs, "segments": s.segments,
                                         "finish": s.finish, "meta": _meta_state(s.meta), "parts": s.parts}
                                        for s in g.samples]} for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [Group(g["position"], [Sample(**s) for s in g["samples"]]) for g in state["groups"]]


def _meta_state(meta: dict) -> dict:
    """What of a meta_info a checkpoint keeps: the replay records (the rest is not read once a sample is carried)."""
    return {k: meta[k] for k in ("routed_experts", "indexer_topk") if k in meta}


# ---------------------------------------------------------------------------------------------- one round
@dataclass
class RoundStats:
    """One dynamic-sampling round of `collect`: what was sent, what came back, what was kept and why not."""

    round: int                      # 1-based, within the step
    sent: int                       # prompts (groups) requested, carried ones included
    answered: int                   # groups that came back whole and were rewarded
    kept: int                       # groups kept this round (dynamic sampling: rewards not all equal)
    kept_total: int                 # groups kept so far this step (capped at target)
    target: int                     # grpo.n_prompts
    equal: dict = field(default_factory=dict)  # reward value -> groups whose rewards all equal it
    truncated: int = 0              # samples cut at rollout.max_new_tokens
    samples: int = 0                # samples that came back
    too_long: int = 0               # prompts over the servers' context length
    seconds: float = 0.0
    tail: int = 0                   # groups left unfinished when the step closed (aborted, or never sent)
    carried: int = 0                # carried groups continued in this round


def _num(x: float) -> str:
    return f"{x:g}"


def round_line(r: RoundStats, where: str, cfg) -> str:
    """One line a round: prompts sent, groups kept, the share of all-equal-reward groups; a round that keeps
    nothing under dynamic sampling is a warning naming the cause (the rewards every group shared)."""
    n_equal = sum(r.equal.values())
    share = f"{n_equal / r.answered:.0%}" if r.answered else "-"
    parts = ", ".join(f"{c} all {_num(v)}" for v, c in sorted(r.equal.items()))
    extra = (f", {r.carried} carried" if r.carried else "") + (f", {r.tail} aborted in the tail" if r.tail else "")
    if r.kept or not cfg.grpo.dynamic_sampling:
        return (f"{where} round {r.round}: {r.sent} prompts sent, {r.kept} of {r.answered} groups kept "
                f"({r.kept_total}/{r.target} so far), {share} all-equal" + (f" ({parts})" if parts else "")
                + extra + f" ({r.seconds:.1f}s)")
    head = f"warning: {where} round {r.round}: 0 of {r.sent} groups kept: "
    if not r.answered:
        return head + (f"no group came back ({r.too_long} prompts over the servers' context length: "
                       f"shorten them or raise the servers' context length)")
    if len(r.equal) == 1:
        (v, _), = r.equal.items()
        why = ("the model never answers correctly" if v == 0 else
               "the model always answers correctly: the prompts are too easy for it" if v == 1 else
               "every sample scored the same")
        cause = f"every group's rewards were equal (all {_num(v)}: {why}"
    else:
        cause = f"every group's rewards were equal ({parts}"
    if r.samples and r.truncated / r.samples >= 0.5:
        cause += (f"; {r.truncated / r.samples:.0%} of the responses were cut at rollout.max_new_tokens="
                  f"{cfg.rollout.max_new_tokens}")
    return head + cause + ") -- dynamic sampling drops them; see grpo.dynamic_sampling"


class _Sender:
    """Sends one round's requests through a pool; once `close()`d, a request not yet sent is never sent (its
    future answers None) and the servers abort what runs."""

    def __init__(self, client, pool, cancel: threading.Event | None):
        self.client, self.pool, self.closed, self.cancel = client, pool, threading.Event(), cancel

    def submit(self, ids, sp, routed: bool, indexed: bool = False):
        kw = {"return_routed_experts": routed, **({"return_indexer_topk": True} if indexed else {})}

        def send():
            if self.closed.is_set() or (self.cancel is not None and self.cancel.is_set()):
                return None
            return self.client.generate(ids, sp, **kw)
        return self.pool.submit(send)

    def close(self, futures, cancel=None) -> None:
        """Close the round: nothing more is sent, and `POST /abort_request {"abort_all": true}` goes to every
        server while a request runs, again every ABORT_REPEAT_S (a request sent as the round closed reaches its
        server after the first abort), until every request has answered."""
        self.closed.set()
        pending = [f for f in futures if not f.done()]
        while pending:
            if cancel is not None and cancel.is_set():
                raise RolloutCancelled("the rollout was cancelled")
            abort_all(self.client)
            pending = list(concurrent.futures.wait(pending, timeout=ABORT_REPEAT_S).not_done)


def _result(fut, cancel):
    """fut.result(), but a rollout the loop cancelled stops here (it polls: the wait itself cannot be woken)."""
    while True:
        if cancel is not None and cancel.is_set():
            raise RolloutCancelled("the rollout was cancelled")
        try:
            return fut.result(timeout=0.2 if cancel is not None else None)
        except concurrent.futures.TimeoutError:
            continue


# ---------------------------------------------------------------------------------------------- the step
def collect(client, task, pos: int, cfg, mcfg, bar=None, on_round=None, carry: Carry | None = None,
            at: int | None = None, version=None, capacity: int | None = None,
            cancel: threading.Event | None = None, history: tuple = (0, 0)) -> tuple[list, list, int, dict]:
    """Dynamic-sampling rollout of step `at` under the run's `cfg` (grpo, rollout, train.seed) for the model
    `mcfg`, the servers holding the weights of step `version` (the last push). `carry`: the partial groups
    (rollout.partial; continued first, and refilled with this step's tail). `capacity`: sequences the servers
    run at once (None: unknown). `cancel`: set by the loop to stop a rollout running in the background.
    `history`: (groups kept, groups rewarded) of the step before, for grpo.adaptive_over_sampling.
    `on_round(RoundStats)` is called after every round. Returns (kept episodes, all rewarded episodes, new
    data position, counters: see the module docstring)."""
    gc, rc = cfg.grpo, cfg.rollout
    G, n = gc.n_prompts, gc.group_size
    st = _Step(client, task, cfg, mcfg, carry if rc.partial else None, at, version, cancel, reward_counts(task))
    if st.carry is not None:
        st.drop_stale()
    inflight = inflight_requests(rc, capacity, n)
    while len(st.kept) < G * n and st.rounds < rc.max_rounds:
        carried = st.carry.groups if st.carry is not None else []
        k = grpo.prompts_to_request(len(st.kept) // n, G, len(carried), gc.over_sampling_batch_size)
        if gc.adaptive_over_sampling and k:
            kept, seen = history[0] + len(st.kept) // n, history[1] + len(st.seen) // n
            k = grpo.prompts_for_rate(G - len(st.kept) // n - len(carried), (kept + 1) / (seen + 1),
                                      gc.over_sampling_batch_size)
        groups = carried + [Group(p) for p in range(pos, pos + k)]
        pos += k
        st.run_round(groups, len(carried), inflight, bar, on_round)   # then the carry holds its tail
    return st.finish(pos)


class _Step:
    """The state of one `collect` call (see there)."""

    def __init__(self, client, task, cfg, mcfg, carry, at, version, cancel, before):
        self.client, self.task, self.cfg, self.mcfg, self.carry = client, task, cfg, mcfg, carry
        self.at, self.version, self.cancel, self.before = at, version, cancel, before
        self.kept, self.seen, self.rounds, self.too_long = [], [], 0, []
        self.c = collections.Counter()   # the step's counters
        self.trained_groups: list[Group] = []

    # ------------------------------------------------------------------ carried groups
    def staleness(self, oldest) -> int | None:
        """Staleness at training time of tokens sampled by the weights of step `oldest` (None: unknown)."""
        return None if self.at is None or oldest is None else (self.at - 1) - int(oldest)

    def drop_stale(self) -> None:
        """Carried groups whose oldest tokens would be trained more than rollout.max_staleness steps late."""
        keep = []
        for g in self.carry.groups:
            s = self.staleness(g.oldest())
            if s is not None and s > self.cfg.rollout.max_staleness:
                self.c["partial_dropped_stale"] += 1
            else:
                keep.append(g)
        self.carry.groups = keep

    # ------------------------------------------------------------------ requests
    def problem(self, g: Group):
        return self.task.train[g.position % len(self.task.train)]

    def _needs(self, g: Group) -> list:
        """What group `g` must still ask for: [None] (a whole new group: one request of n samples) or the
        indices of its unfinished samples (one request each). A sample with no token budget left ends as it
        is (Miles: TRUNCATED)."""
        if not g.samples:
            return [None]
        out = []
        for j, s in enumerate(g.samples):
            if not s.finish and len(s.ids) >= self.cfg.rollout.max_new_tokens:
                s.finish = "length"
            if not s.finish:
                out.append(j)
        return out

    def _submit(self, g: Group, j, sender):
        """The request for `j` of group `g` (see `_needs`) -> its future."""
        rc, task, seed = self.cfg.rollout, self.task, self.cfg.train.seed
        prompt = task.encode(self.problem(g))
        sp = {"temperature": rc.temperature, "top_p": rc.top_p, "stop_token_ids": list(task.stop_ids)}
        if j is None:
            sp.update(n=self.cfg.grpo.group_size, max_new_tokens=rc.max_new_tokens,
                      sampling_seed=request_seed(seed, g.position))
            return sender.submit(prompt, sp, rc.routing_replay, rc.indexer_replay)
        s = g.samples[j]
        sp.update(n=1, max_new_tokens=rc.max_new_tokens - len(s.ids),
                  sampling_seed=continuation_seed(seed, g.position, j, s.parts))
        return sender.submit(prompt + s.ids, sp, rc.routing_replay, rc.indexer_replay)

    def _answers(self, g: Group, reqs, r: RoundStats) -> bool:
        """Apply the answers of group `g`'s requests [(j, future)]; False if the group is lost (its prompt is
        over the servers' context length)."""
        for j, fut in reqs:
            try:
                gens = _result(fut, self.cancel)
            except RequestRejected as e:  # over the server's context length: skipped and counted
                if not e.too_long:
                    raise
                self.too_long.append(e.message)
                return False
            if gens is None:              # closed before it was sent: nothing came back
                continue
            check_versions(gens, getattr(self.client, "weight_version", None))
            if j is None:
                g.samples = [Sample() for _ in gens]
            for s, gen in zip(g.samples if j is None else [g.samples[j]], gens):
                s.add(gen, self.version, self.at)
                self.c["tokens_generated"] += len(gen.output_ids)
                if s.finish:
                    self.c["samples_generated"] += 1
                    r.samples += 1
                    r.truncated += s.finish == "length"
                else:
                    self.c["samples_aborted"] += 1
        return True

    # ------------------------------------------------------------------ a round
    def run_round(self, groups: list, n_carried: int, inflight, bar, on_round) -> None:
        """Send every request of `groups` (at most `inflight` at once), take the answers in order, close the
        step at the G-th kept group (the tail: never sent, or aborted), carry or discard what is left."""
        G, n = self.cfg.grpo.n_prompts, self.cfg.grpo.group_size
        t0, n_long = time.time(), len(self.too_long)
        r = RoundStats(self.rounds + 1, len(groups), 0, 0, 0, G, carried=n_carried)
        equal, tail, self.leftover = collections.Counter(), [], []
        needs = [self._needs(g) for g in groups]
        with request_pool(self.client, inflight or max(1, sum(map(len, needs)))) as pool:
            sender = _Sender(self.client, pool, self.cancel)
            reqs = [[(j, self._submit(g, j, sender)) for j in need] for g, need in zip(groups, needs)]
            futures = [f for rs in reqs for _, f in rs]
            for g, rs in zip(groups, reqs):
                if len(self.kept) >= G * n:          # the step has its groups: the rest is the tail
                    tail.append((g, rs))
                    continue
                if not self._answers(g, rs, r):
                    continue
                if not g.done:                       # aborted by someone else's abort: carried or dropped
                    self._tail(g)
                    continue
                if self._reward(g, r, equal) and bar is not None:
                    bar.update(1)                    # the bar counts kept groups against the target G
            if tail:
                sender.close(futures, self.cancel)   # nothing more is sent; what runs is aborted, then drained
            for g, rs in tail:                       # what the tail returns: partial, finished, or never sent
                if rs:
                    self._answers(g, rs, r)
                self._tail(g)
        if self.carry is not None:    # only now: a round that fails (a server gone) leaves the carry as it was
            self.carry.groups = self.leftover
        self.rounds += 1
        r.kept_total, r.equal, r.too_long = min(len(self.kept) // n, G), dict(equal), len(self.too_long) - n_long
        r.tail, r.seconds = sum(not g.done for g, _ in tail), time.time() - t0
        if on_round is not None:
            on_round(r)

    def _reward(self, g: Group, r: RoundStats, equal) -> bool:
        """Reward a finished group; keep it if dynamic sampling does (its samples -> episodes)."""
        gc, m = self.cfg.grpo, self.mcfg
        gens = [_Gen(s) for s in g.samples]
        eps = _episodes(gens, self.task.encode(self.problem(g)), g.position, self.task, self.problem(g), m,
                        self.cfg.rollout.indexer_replay)
        self.seen += eps
        varied = grpo.filter_groups(eps, gc.group_size)
        if not varied:
            equal[eps[0].reward] += 1
        good = varied if gc.dynamic_sampling else eps
        for e in eps if not good else ():   # a dropped group (one prompt's samples): its replay records are
            e.routed_experts = e.indexer_topk = None   # never trained; rank 0 holds only what it will train
        if good:
            self.kept += good
            self.trained_groups.append(g)
        r.answered, r.kept = r.answered + 1, r.kept + bool(good)
        return bool(good)

    def _tail(self, g: Group) -> None:
        """A group not taken when the step closed: carried (partial rollouts) or discarded."""
        self.c["tail_groups"] += 1
        if self.carry is not None:
            self.leftover.append(g)
        else:
            self.c["samples_unused"] += sum(bool(s.finish) for s in g.samples)

    # ------------------------------------------------------------------ the step's numbers
    def finish(self, pos: int) -> tuple[list, list, int, dict]:
        G, n = self.cfg.grpo.n_prompts, self.cfg.grpo.group_size
        if self.too_long:
            print(f"rollout: {len(self.too_long)} prompt(s) over the servers' context length skipped "
                  f"({self.too_long[0]})")
        now, c = reward_counts(self.task), self.c
        trained = [s for g in self.trained_groups for s in g.samples]
        tok, old = sum(len(s.ids) for s in trained), sum(s.tokens_before(self.at) for s in trained)
        counts = {"rounds": self.rounds, "groups_kept": min(len(self.kept) // n, G), "groups_seen": len(self.seen) // n,
                  "prompts_too_long": len(self.too_long), "samples_generated": c["samples_generated"],
                  "samples_trained": len(trained), "samples_aborted": c["samples_aborted"],
                  "samples_unused": c["samples_unused"], "tokens_generated": c["tokens_generated"],
                  "tokens_trained": tok, "tail_groups": c["tail_groups"],
                  "generated_per_trained": c["samples_generated"] / len(trained) if trained else None,
                  "partial_samples": sum(s.tokens_before(self.at) > 0 for s in trained),
                  "partial_token_share": old / tok if tok else 0.0,
                  "partial_carried_groups": len(self.carry) if self.carry is not None else 0,
                  "partial_dropped_stale": c["partial_dropped_stale"],
                  "trained_groups": [g.position for g in self.trained_groups],   # data positions: each once a run
                  **{f"reward_{k}": v - self.before.get(k, 0) for k, v in sorted(now.items())}}
        ages = [a for a in (self.staleness(s.oldest()) for s in trained) if a is not None]
        if ages:
            counts.update(staleness_mean=sum(ages) / len(ages), staleness_max=max(ages),
                          **{f"staleness_{a}": ages.count(a) for a in sorted(set(ages))})
        return self.kept, self.seen, pos, counts


@dataclass
class _Gen:
    """A finished Sample seen as one Generation (what `_episodes` reads)."""

    output_ids: list
    logprobs: list
    finish_reason: str
    meta_info: dict

    def __init__(self, s: Sample):
        self.output_ids, self.logprobs, self.finish_reason, self.meta_info = s.ids, s.logprobs, s.finish, s.meta

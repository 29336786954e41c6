"""The embedded rollout engine: nanoflash's own inference behind the SGLang-protocol server (`server.py`).

Generation, per request (one prompt, n samples: n rows that decode together):

    prefill the prompt, then repeat: logits_t -> sample -> append, until a stop id or max_new_tokens
    sample:  p = softmax(logits / T), keep the top-k, keep the smallest set with cumulative p >= top_p,
             renormalise, draw (T = 0: argmax) -- from the request's own generator (its sampling_seed)
    score:   logprob_t = log_softmax(logits / T)[token_t]  -- recomputed at the end by the trainer's own
             `model.token_logprobs` on each finished sequence ("true on-policy"; T = 0 is scored at T = 1)

Continuous batching. The requests in flight share ONE model forward per step. A step (`_step`, under `lock`):

    1. requests aborted since the last step leave (with the tokens they have, scored);
    2. the admitted requests waiting at this step boundary join the batch;
    3. `_next_logits`: one decode forward over every row that has a cache, each row at its own position
       (`model(ids [B,1], start_pos=[B] lengths - 1, cache)`: rows of different prompt lengths or joined at
       different steps decode together), then one prefill per distinct length for the rows that joined, whose
       caches are appended to the batch's (`model.cat_caches`);
    4. each request draws its rows' tokens from its own generator -- the same draws as alone, on logits that
       differ from a batch of one only in the last bits (other GEMM shapes), so a fixed seed gives the same
       samples unless a draw lands within ~1e-6 of a boundary;
    5. requests whose every row stopped, or that reached max_new_tokens, leave: their rows are dropped from the
       cache (`model.cache_rows`, on the next step) and their samples are scored.

A stopped row keeps decoding (its tokens are cut) until its request ends, so a request draws for n rows every
step, exactly as alone. On the GPU a forward at these sizes costs its kernel launches (thousands per forward on
the reference path, most of them in mHC's Sinkhorn iterations and the fp32 expert loop, which the model's decode
seam `decode_kernels` replaces by a few launches per block: `bench/bench_rollout.py --part launches`), not its
arithmetic, so a step over 64 rows costs about what one over 8 did: the `gpu` recipe's rollout of
8 requests x 8 samples x 16 tokens ran 8 x 16 forwards + 64 scoring forwards before, and ~16 + 1 now.
`batching="serial"` keeps the engine before this (one request at a time, its n rows as one batch): the bench's
baseline (`bench/bench_rollout.py --part batching`) and the reference of `tests/test_rollout_batching.py`.

Who runs the steps: the thread of one request in flight (the driver) runs steps for all of them, the others
wait on `resume` and are woken after each step; when the driver's request ends another waiting thread takes
over. Between steps the lock is free, so a weight push, a pause or a new request gets in at a step boundary.

Scoring (`score=`): "exact" scores each sample alone, the call the trainer makes in matched precision (fp32
trainer and engine score per sample, `rl/trainer.py`), so the log-probs equal the trainer's bit for bit;
"batched" scores every sample finished in a step in ONE right-padded forward per temperature. Padding after a
sample changes none of its positions (every block is causal: the window and the compressed entries end at the
query, the indexer sees only ended windows, MoE and mHC act per token; tests/test_model.py checks it), but
the GEMM shapes differ, so the bits may: on the CPU fp32 the padded log-probs were <= 1e-6 from a batch of
one. "auto": exact on the CPU and with fp32 weights, batched otherwise (the FP8 and bf16 engines differ from a
bf16 trainer by ~0.08 anyway, docs/benchmarks.md B11). A lone sample is always scored alone.

Replay records, in SGLang's format (base64 int32, one row per input position of the scoring forward:
prompt + output - 1), from that same scoring forward -- exactly what a trainer forward on the same tokens and
weights computes: with `return_routed_experts` (R3) [rows, n_layers, top-k], the experts every MoE layer chose;
with `return_indexer_topk` (indexer replay) [rows, C4 layers, index_topk], the entries each C4 layer's indexer
kept (-1 padded), layer j the model's j-th C4 layer (`model.c4_layers`), as SGLang 0.5.16 reports them.

Decoding uses the model's incremental cache when a start-up self-check (two rows at different positions, one
step, against the full forward) agrees, else re-runs the full forward of every row each step, right-padded
(`decode="auto"|"cache"|"full"`). Requests wait at step boundaries while generation is paused
(`in_place`/`retract`; `abort` ends them: with no tokens, as nothing is scored during a pause); a weight update
bumps `epoch`, and every cached request re-prefills (SGLang's "retract": recompute from scratch rather than
keep stale KV).

Weights: the engine keeps what was pushed in SGLang's loader layout (`layout.LoaderState`) and derives the
model's parameters from it in `post_process()` -- unfuse pairs, un-permute `ape`, dequantize FP8 blocks,
int32 `tid2eid` -> int64. Modes: "fp32"/"bf16" run the model in that dtype; "fp8" runs on the dequantized
e4m3 weights (what an FP8 engine computes with, minus its activation quantization). Cost: the pushed layout
is kept next to the model's parameters (about 2x weight memory; fine for tiny/small, not for flash). `post_process` runs
after every update call (stock protocol) or at `end_weight_update` / `post_process_weights`; until then the
model still runs the old derived weights, which the checksum of the derived state (`derived_checksum`, on
`/weights_checker` when asked) shows.

Tests: `pytest tests/test_rollout_server.py tests/test_rollout_batching.py -q`.
"""
from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import torch

from nanoflash.model import Indexer, c4_layers
from nanoflash.quant import FP8_BLOCK, dequantize_fp8_block
from nanoflash.sglang.layout import LoaderState, from_sglang, unpermute_ape
from nanoflash.sglang.transports import iter_sglang_buckets

# cache vs full-forward logits at start-up: only a broken cache (O(1) errors) must fail. fp32: reductions reorder
# (~1e-6 seen); bf16: one rounding of 2^-8 relative on logits of order 1-10.
CACHE_CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
MAX_N = 64                # samples per request
# Smallest non-zero temperature: logits / T must stay finite in fp32 (|logit| <~ 1e3, so T >= 1e-6 keeps them
# below 1e9; T = 1e-45 overflows to inf and softmax gives NaN). SGLang samples greedily below its own 1e-6 eps;
# here T = 0 asks for greedy and 0 < T < MIN_TEMPERATURE is refused rather than switched silently.
MIN_TEMPERATURE = 1e-6
HEALTH_PROMPT = [0]       # /health_generate: one greedy token after this prompt
# Sequences decoding at once (SGLang's --max-running-requests): a request of n samples takes n; the next waits
# in a queue until enough finish. The engine runs one forward at a time, so this bounds memory and the threads
# holding a request, not speed: 256 = 4 x the h200 recipe's 64 running, 2x the demo's 16 prompts x 8.
DEFAULT_MAX_RUNNING = 256
# pause_generation(mode="abort") returns once nothing runs (SGLang waits the same way); a request ends at its
# next decode step, so this only bounds a stuck forward.
PAUSE_DRAIN_S = 60.0
# A new batch (nothing decoding) starts this long after its first request arrived: requests sent together (a
# rollout round's) reach the server over a few ms, and each one that misses the first step costs a prefill forward
# of its own (~80 ms of launches on the `gpu` recipe) and, finishing a step apart, a scoring forward of its own.
JOIN_QUIET_S, JOIN_GATHER_S = 0.003, 0.02   # measured on the 2-core CPU: 8 requests of a round over 2-7 ms
SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                 "min_new_tokens", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens",
                 "ignore_eos", "stop"}
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}
BATCHING = ("continuous", "serial")      # RolloutEngine(batching=): every running request per forward, or one
SCORING = ("auto", "exact", "batched")   # RolloutEngine(score=): see the module docstring
RECORDS = ("routed_experts", "indexer_topk")   # replay records a request may ask for (SGLang's meta_info keys)


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400)."""


def check_ids(route: str, ids, vocab: int) -> list:
    """`ids` if it is a non-empty list of token ids in [0, vocab), else one BadRequest naming the route."""
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise BadRequest(f"{route}: input_ids must be a non-empty list of ints in [0, {vocab}), got {str(ids)[:80]}")
    return ids


def parse_sampling(sp: dict, vocab: int) -> dict:
    """Validate SGLang sampling params; unknown keys and bad values raise BadRequest naming them."""
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params {unknown}; supported: {sorted(SAMPLING_KEYS)}")
    if sp.get("stop"):
        raise BadRequest("sampling_params.stop (strings) needs a tokenizer; use stop_token_ids")
    out = {"n": sp.get("n", 1), "temperature": sp.get("temperature", 1.0), "top_p": sp.get("top_p", 1.0),
           "top_k": sp.get("top_k", -1), "max_new_tokens": sp.get("max_new_tokens", 128),
           "stop_token_ids": sp.get("stop_token_ids") or [], "seed": sp.get("sampling_seed")}
    T = out["temperature"]
    checks = [("n", _is_int(out["n"]) and 1 <= out["n"] <= MAX_N, f"an int in [1, {MAX_N}]"),
              ("temperature", _is_real(T) and (T == 0 or MIN_TEMPERATURE <= T), f"0 (greedy) or >= {MIN_TEMPERATURE}"),
              ("top_p", _is_real(out["top_p"]) and 0 < out["top_p"] <= 1, "in (0, 1]"),
              ("top_k", _is_int(out["top_k"]) and (out["top_k"] == -1 or out["top_k"] >= 1), "-1 or >= 1"),
              ("max_new_tokens", _is_int(out["max_new_tokens"]) and out["max_new_tokens"] >= 0, "an int >= 0"),
              ("stop_token_ids", isinstance(out["stop_token_ids"], list)
               and all(_is_int(t) and 0 <= t < vocab for t in out["stop_token_ids"]), f"ids in [0, {vocab})"),
              ("sampling_seed", out["seed"] is None or _is_int(out["seed"]), "an int")]
    for key, ok, want in checks:
        if not ok:
            raise BadRequest(f"sampling_params.{key}={sp.get(key)!r} is invalid: want {want}")
    return out


def _is_int(v) -> bool:
    return type(v) is int  # not bool, not a float such as 2.0


def _is_real(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def check_finite(logits: torch.Tensor) -> None:
    """Non-finite logits are an error naming the cause (broken served weights), never a silent draw."""
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("non-finite logits: the served weights are broken (NaN/inf or overflowing, "
                                 "e.g. a diverged update)")


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen: torch.Generator,
           check: bool = True):
    """Draw one token per row. logits [B,V] fp32 -> ids [B]. `check`: `check_finite` first (a caller that
    checked a larger batch at once passes False)."""
    if check:
        check_finite(logits)
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)                 # [B,V]
    if top_k > 0:
        kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[:, -1:]      # [B,1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)                             # [B,V]
        drop = sp.cumsum(-1) - sp > top_p                                         # mass before this token
        probs = probs.scatter(-1, idx, sp.masked_fill(drop, 0.0))
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[:, 0]


def check_values(name: str, t: torch.Tensor, n_experts: int) -> None:
    """A pushed tensor the model can run: floats (FP8 included) finite, an expert table (`tid2eid`) within
    [0, n_experts); else ValueError naming it (the update's 400), never a 200 that fails at /generate."""
    if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
        raise ValueError(f"pushed {name} holds NaN/inf values")
    if name.endswith("tid2eid") and t.numel() and not (0 <= int(t.min()) and int(t.max()) < n_experts):
        raise ValueError(f"pushed {name} holds expert ids in [{int(t.min())}, {int(t.max())}], outside "
                         f"[0, {n_experts})")


class RolloutEngine:
    """nanoflash inference + SGLang-layout weight store. Thread-safe: one forward at a time (`lock`).
    `batching`: "continuous" (every running request in each step's forward) or "serial" (one request at a time,
    the engine before continuous batching); `score`: "exact", "batched" or "auto" (module docstring)."""

    def __init__(self, model, weights: str = "fp32", decode: str = "auto", seed: int = 0,
                 max_running: int = DEFAULT_MAX_RUNNING, batching: str = "continuous", score: str = "auto"):
        if weights not in WEIGHT_DTYPES:
            raise ValueError(f"weights must be one of {sorted(WEIGHT_DTYPES)}, got {weights!r}")
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if batching not in BATCHING or score not in SCORING:
            raise ValueError(f"batching must be one of {BATCHING} and score one of {SCORING}, got {batching!r}, "
                             f"{score!r}")
        self.max_running, self.running, self.slots = max_running, 0, threading.Condition()
        self.model, self.cfg, self.weights = model.eval(), model.cfg, weights
        self.device = next(model.parameters()).device
        self.lock = threading.RLock()
        self.resume = threading.Condition(self.lock)
        self.paused, self.epoch, self.weight_version = False, 0, "0"
        self.aborted: set = set()    # in-flight request ids that were aborted
        self.inflight: collections.Counter = collections.Counter()   # rid -> requests running under it
        self.abort_all_before = 0.0
        self.seed_gen = torch.Generator().manual_seed(seed)
        self.batching = batching
        self.waiting: list = []      # admitted requests; they join the batch at the next step
        self.batch: list = []        # decoding: their rows, in this order, are the rows of state["cache"]
        self.finished: list = []     # decoded, not yet scored (a step that ended in a pause)
        self.state: dict = {}        # `_next_logits`' decode cache of the batch; reset when the batch empties
        self.driver = None           # the request whose thread runs the steps now
        self.store = LoaderState()
        fp8 = weights == "fp8"
        for bucket in iter_sglang_buckets(model, fp8=fp8, bucket_bytes=1 << 62):
            self.store.load(bucket)
        self.store.freeze()
        self.post_process()
        self.use_cache = decode == "cache" or (decode == "auto" and self._cache_agrees())
        # the trainer's matched-precision log-probs (fp32 both sides) score each sample alone: so does "exact"
        exact = self.device.type == "cpu" or weights == "fp32"
        self.score_mode = score if score != "auto" else ("exact" if exact else "batched")

    # ------------------------------------------------------------------ weights
    def load(self, named_tensors) -> list:
        with self.lock:
            return self.store.load(named_tensors)

    @torch.no_grad()
    def post_process(self):
        """Re-derive the model's parameters from the stored SGLang layout (the post-load quantization step)."""
        with self.lock:  # all-or-nothing: every name, shape and value is checked before the first tensor goes live
            target = dict(self.model.state_dict(keep_vars=True))
            for name, t in self.store.params.items():  # views only: nothing is dequantized twice
                check_values(name, t, self.cfg.n_routed_experts)
                for official, part, _ in ([] if name.endswith("_scale_inv") else self._split(name, t, None)):
                    if official not in target:
                        raise ValueError(f"pushed tensor {official} has no place in this model")
                    if tuple(part.shape) != tuple(target[official].shape):
                        raise ValueError(f"pushed {official} has shape {tuple(part.shape)}, model wants "
                                         f"{tuple(target[official].shape)}")
            for name, t in self._unfused():
                target[name].data.copy_(t.to(self.device, target[name].dtype))
            self.epoch += 1

    def _unfused(self):
        """Stored layout -> (official name, dense tensor): unfuse, un-permute, dequantize FP8 per half."""
        p = self.store.params
        for name, t in p.items():
            if name.endswith("_scale_inv"):
                continue
            scale = p.get(name + "_scale_inv")
            if t.dtype == torch.float8_e4m3fn and scale is None:
                raise ValueError(f"FP8 tensor {name} arrived without its weight_scale_inv")
            for official, part, s in self._split(name, t, scale):
                if part.dtype == torch.float8_e4m3fn:
                    part = dequantize_fp8_block(part, s, torch.float32)
                yield official, part

    def _split(self, name: str, t: torch.Tensor, scale):
        """A stored tensor -> [(official name, tensor, its scale rows or None)]."""
        splits = {"self_attn.wqkv_a.weight": ("self_attn.wq_a.weight", "self_attn.wkv.weight",
                                              self.cfg.q_lora_rank),
                  "compressor.wkv_gate.weight": ("compressor.wkv.weight", "compressor.wgate.weight", None),
                  "gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight", None),
                  "w13_weight": ("gate_proj.weight", "up_proj.weight", None)}
        for fused, (a, b, rows) in splits.items():
            if name.endswith(fused):
                stem, rows = name[: -len(fused)], rows or t.shape[0] // 2
                srows = -(-rows // FP8_BLOCK)  # each half was quantized on its own: its scale rows
                sa, sb = (None, None) if scale is None else (scale[:srows], scale[srows:])
                return [(from_sglang(stem + a), t[:rows], sa), (from_sglang(stem + b), t[rows:], sb)]
        if name.endswith("w2_weight"):
            return [(from_sglang(name[: -len("w2_weight")] + "down_proj.weight"), t, scale)]
        if name.endswith("compressor.ape") and t.shape[0] == 4:
            return [(from_sglang(name), unpermute_ape(t), None)]
        if name.endswith("mlp.topk.tid2eid"):
            return [(from_sglang(name), t.to(torch.int64), None)]
        return [(from_sglang(name), t, scale)]

    def derived_checksum(self) -> str:
        """One hash over the parameters the model actually runs with (catches a skipped post_process)."""
        with self.lock:  # sha256 of the concatenated fp32 bytes, fed one tensor at a time (no full copy)
            h = hashlib.sha256()
            for _, t in sorted(self.model.state_dict().items()):
                h.update(t.detach().float().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            return h.hexdigest()

    # ------------------------------------------------------------------ pause / abort
    def pause(self, mode: str):
        """SGLang's pause_generation: new and running requests wait (in_place / retract: a request re-prefills
        after a weight update, `epoch`); "abort" also ends every request and returns once none runs (SGLang
        0.5.16 `TokenizerManager.pause_generation` aborts, then waits on its model_update_lock)."""
        with self.lock:
            self.paused = True
            if mode == "abort":
                self.abort_all_before = time.monotonic()
        if mode == "abort":
            self._wake()
            with self.slots:
                self.slots.wait_for(lambda: self.running == 0, timeout=PAUSE_DRAIN_S)

    def unpause(self):
        with self.lock:
            self.paused = False
            self.resume.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False):
        """SGLang's /abort_request: a queued request ends at once with no tokens, a running one at its next
        decode step with the tokens it has (scored: its log-probs come back too); abort_all ends every request
        that arrived before it. An unknown rid is a no-op (as in SGLang), so `aborted` holds in-flight ids only
        and each leaves it when its request ends."""
        with self.lock:
            if abort_all:
                self.abort_all_before = time.monotonic()
            elif rid and rid in self.inflight:
                self.aborted.add(rid)
        self._wake()

    def _wake(self):
        with self.lock:
            self.resume.notify_all()
        with self.slots:
            self.slots.notify_all()

    def _is_aborted(self, rid: str, t0: float) -> bool:
        return t0 < self.abort_all_before or rid in self.aborted

    def _admit(self, rid: str, t0: float, n: int) -> bool:
        """Wait in the queue until n sequences fit under max_running (alone, a larger request runs); False if
        the request is aborted while it waits."""
        with self.slots:
            while self.running and self.running + n > self.max_running:
                if self._is_aborted(rid, t0):
                    return False
                self.slots.wait(timeout=0.5)
            if self._is_aborted(rid, t0):
                return False
            self.running += n
            return True

    def _release(self, n: int):
        with self.slots:
            self.running -= n
            self.slots.notify_all()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def _cache_agrees(self) -> bool:
        """Start-up self-check of the decode path the scheduler runs: two prompts of different lengths
        prefilled alone, joined (`cat_caches`), one step each at its own position, against the full forward."""
        ids = torch.arange(1, 11, device=self.device)[None] % self.cfg.vocab_size       # [1,10]
        rows = (ids[:, :9], ids[:, 3:8])                                                 # lengths 9 and 5
        try:
            with self.lock:
                full = torch.stack([self.model(r)[0, -1] for r in rows])                 # [2,V]
                caches = [self.model.new_cache() for _ in rows]
                for r, c in zip(rows, caches):
                    self.model(r[:, :-1], 0, c)
                pos = torch.tensor([r.shape[1] - 1 for r in rows])
                step = self.model(torch.cat([r[:, -1:] for r in rows]), pos, self.model.cat_caches(caches))[:, -1]
        except Exception:  # an incomplete cache implementation: fall back to full forwards
            return False
        tol = CACHE_CHECK_ATOL.get(self.model.embed.weight.dtype, 5e-2)
        return bool((full - step).abs().max() <= tol)

    def _next_logits(self, reqs: list, state: dict) -> torch.Tensor:
        """Logits of the next token of every row of `reqs` (each request's n rows, in order): ONE decode forward
        over the rows `state` holds a cache for, each at its own position, then one prefill per prompt length
        for the requests that join (or re-join: after a weight update every request re-prefills, SGLang's
        retract). -> [rows, V] fp32"""
        if not self.use_cache:
            return self._full_logits(reqs)
        if state.get("epoch") != self.epoch:
            state.update(epoch=self.epoch, cache=None, reqs=[])
        held, logits = self._keep_rows(state, reqs), {}
        if held:
            ids = torch.tensor([[o[-1]] for r in held for o in r.out], device=self.device)     # [B,1]
            pos = torch.tensor([r.length - 1 for r in held for _ in range(r.n)])               # [B] host
            self._by_request(self.model(ids, pos, state["cache"])[:, -1], held, logits)
        kept = {id(r) for r in held}
        caches, new = [state["cache"]] if held else [], [r for r in reqs if id(r) not in kept]
        for length in sorted({r.length for r in new}):
            group = [r for r in new if r.length == length]
            caches.append(self.model.new_cache())
            ids = torch.tensor([r.prompt + o for r in group for o in r.out], device=self.device)  # [n,L]
            self._by_request(self.model(ids, 0, caches[-1])[:, -1], group, logits)
            held = held + group
        if new:
            state["cache"] = self.model.cat_caches(caches)
        state["reqs"] = held
        return torch.cat([logits[id(r)] for r in reqs])

    def _keep_rows(self, state: dict, reqs: list) -> list:
        """Drop from the cache the rows of requests that left; -> the requests it still holds, in row order."""
        now = {id(r) for r in reqs}
        held = [r for r in state["reqs"] if id(r) in now]
        if len(held) < len(state["reqs"]):
            offs = [0]
            for r in state["reqs"]:
                offs.append(offs[-1] + r.n)
            rows = [offs[k] + i for k, r in enumerate(state["reqs"]) if id(r) in now for i in range(r.n)]
            state["cache"] = self.model.cache_rows(state["cache"], torch.tensor(rows, device=self.device))
        return held

    @staticmethod
    def _by_request(logits: torch.Tensor, reqs: list, out: dict) -> None:
        a = 0
        for r in reqs:
            out[id(r)], a = logits[a:a + r.n], a + r.n

    def _full_logits(self, reqs: list) -> torch.Tensor:
        """decode="full": one forward of every row's whole sequence, right-padded (causal: the padding after a
        row changes none of its logits), the logits at each row's last token. -> [rows, V]"""
        seqs = [r.prompt + o for r in reqs for o in r.out]
        L = max(len(x) for x in seqs)
        ids = torch.tensor([x + [0] * (L - len(x)) for x in seqs], device=self.device)     # [B,L]
        last = torch.tensor([len(x) - 1 for x in seqs], device=self.device)
        return self.model(ids)[torch.arange(len(seqs), device=self.device), last]

    @torch.no_grad()
    def health_check(self) -> None:
        """One greedy token after HEALTH_PROMPT on the served weights, scored; raises what generation raises
        (FloatingPointError on NaN weights). Does not wait for a pause: the model's parameters change only
        under `lock`, in post_process, so a forward under it sees one consistent set."""
        with self.lock:   # every weight, not only the rows one prompt reads (an inf in one embedding row)
            bad = [n for n, p in self.model.state_dict().items() if p.is_floating_point()
                   and not bool(torch.isfinite(p).all())]
            if bad:
                raise FloatingPointError(f"non-finite weights in {bad[:3]}")
            ids = torch.tensor([HEALTH_PROMPT], dtype=torch.long, device=self.device)        # [1,1]
            nxt = sample(self.model(ids)[:, -1], 0.0, 1.0, -1, None)                         # [1]
            lp = self.score(torch.cat([ids[0], nxt]), len(HEALTH_PROMPT), 1.0)
        if not all(math.isfinite(x) for x in lp):
            raise FloatingPointError(f"non-finite log-prob {lp} of the health token")

    @torch.no_grad()
    def generate(self, input_ids: list, sp: dict, rid: str | None = None, records: tuple = ()) -> list:
        """One prompt, `sp['n']` samples -> SGLang-shaped result dicts; `records`: the replay records (RECORDS)
        each result carries."""
        unknown = set(records) - set(RECORDS)
        if unknown:
            raise BadRequest(f"replay records {sorted(unknown)} unknown: this engine reports {list(RECORDS)}")
        rid, t0 = rid or uuid.uuid4().hex, time.monotonic()
        max_len = self.cfg.max_seq_len
        if len(input_ids) + sp["max_new_tokens"] > max_len:  # "context length": the phrase SGLang's 400 uses too
            raise BadRequest(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sp['max_new_tokens']}) exceeds "
                             f"the model's context length (max_seq_len {max_len})")
        with self.lock:
            self.inflight[rid] += 1
        n = sp["n"]
        try:
            if not self._admit(rid, t0, n):   # aborted in the queue: SGLang answers "abort" with no tokens
                with self.lock:
                    version = self.weight_version
                fr = {"type": "abort", "message": "Abort in waiting queue"}
                return [self._answer(rid, t0, input_ids, sp, [], [], fr, version) for _ in range(n)]
            try:
                return self._run(self._request(input_ids, sp, rid, t0, tuple(records)))
            finally:
                self._release(n)
        finally:
            with self.lock:
                self.inflight[rid] -= 1
                if not self.inflight[rid]:
                    del self.inflight[rid]
                    self.aborted.discard(rid)

    def _request(self, prompt: list, sp: dict, rid: str, t0: float, records: tuple) -> "Request":
        with self.lock:
            seed = sp["seed"] if sp["seed"] is not None else int(torch.randint(0, 2**62, (1,), generator=self.seed_gen))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return Request(rid, t0, list(prompt), sp, records, gen, [[] for _ in range(sp["n"])], [None] * sp["n"])

    def _run(self, req: "Request") -> list:
        """Wait for `req`'s result, running the steps while no other request's thread does (the driver: one
        thread at a time runs every request's steps; the others wait on `resume`, woken after each step)."""
        with self.lock:
            self.waiting.append(req)
        try:
            while True:
                with self.lock:
                    if req.error is not None:
                        raise req.error
                    if req.result is not None:
                        return req.result
                    if self.paused and self._is_aborted(req.rid, req.t0):   # cannot be scored: a push may be half done
                        self._end_unscored(req)
                        continue
                    if self.paused or self.driver not in (None, req):
                        self.resume.wait(timeout=0.5)
                        continue
                    self.driver = req
                    if not self.batch and not req.gathered:   # a new batch: let the requests sent with this one in
                        req.gathered = True
                        self._gather()
                        continue
                    try:
                        self._step()
                    except Exception as e:   # every request of the step fails with it, and the batch is reset
                        for r in self.batch + self.finished:
                            r.error = e
                        self.batch, self.finished, self.state = [], [], {}
                    self.resume.notify_all()
                time.sleep(0)   # between steps a push, a pause or a new request may take the lock
        finally:
            with self.lock:
                if self.driver is req:
                    self.driver = None
                    self.resume.notify_all()

    def _gather(self):
        """Before a new batch's first step (under `lock`, released while waiting): wait until no request has
        arrived for JOIN_QUIET_S, at most JOIN_GATHER_S in all."""
        end, seen = time.monotonic() + JOIN_GATHER_S, -1
        while len(self.waiting) != seen and time.monotonic() < end:
            seen = len(self.waiting)
            self.resume.wait(timeout=JOIN_QUIET_S)

    def _step(self):
        """One scheduling step, under `lock`, not paused: end aborted requests (with the tokens they have), let
        the waiting ones join, ONE forward for every row of the batch (`_next_logits`), draw each request's
        next tokens, move finished requests out, score them (unless a pause began meanwhile)."""
        for r in [r for r in self.waiting + self.batch if self._is_aborted(r.rid, r.t0)]:
            self._leave(r)
            r.reason = "abort"
            self.finished.append(r)
        k = len(self.waiting) if self.batching == "continuous" else 0 if self.batch else 1   # serial: one alone
        join, self.waiting = self.waiting[:k], self.waiting[k:]
        self.finished += [r for r in join if r.sp["max_new_tokens"] == 0]
        self.batch += [r for r in join if r.sp["max_new_tokens"] > 0]
        if self.batch:
            self._draw(self._next_logits(self.batch, self.state))
            self.finished += [r for r in self.batch if r.decoded()]
            self.batch = [r for r in self.batch if not r.decoded()]
        if not self.batch:
            self.state = {}   # nothing decodes: the cache goes
        if not self.paused and self.finished:
            self._score_finished()

    def _draw(self, logits: torch.Tensor) -> None:
        """Each request's rows from its own generator (the same draws as when it decoded alone), one host read
        of every drawn id, stop ids checked on the host. logits [rows, V]"""
        check_finite(logits)
        draws, a = [], 0
        for r in self.batch:
            sp = r.sp
            draws.append(sample(logits[a:a + r.n], sp["temperature"], sp["top_p"], sp["top_k"], r.gen, check=False))
            a += r.n
        ids, a = torch.cat(draws).tolist(), 0
        for r in self.batch:
            for i, tok in enumerate(ids[a:a + r.n]):
                r.out[i].append(tok)
                if r.done[i] is None and tok in r.sp["stop_token_ids"]:
                    r.done[i] = (len(r.out[i]), tok)
            a += r.n

    def _leave(self, req: "Request") -> None:
        for queue in (self.waiting, self.batch, self.finished):
            if req in queue:
                queue.remove(req)

    def _end_unscored(self, req: "Request") -> None:
        """Aborted during a pause: it ends now with no tokens (a push may be half applied: nothing is scored)."""
        self._leave(req)
        fr = {"type": "abort", "message": "aborted"}
        req.result = [self._answer(req.rid, req.t0, req.prompt, req.sp, [], [], fr, self.weight_version)
                      for _ in range(req.n)]
        self.resume.notify_all()

    def _score_finished(self) -> None:
        """Score every finished sample with the trainer's `token_logprobs` ("exact": one forward per sample;
        "batched": one right-padded forward per temperature), read the replay records it asked for from that
        forward, and build the results."""
        reqs = list(self.finished)   # they leave `finished` once scored (a failure reaches them from there)
        items = [(r, i) for r in reqs for i in range(r.n)]
        fulls = [r.prompt + r.output(i) for r, i in items]
        lps, recs = [[] for _ in items], [None] * len(items)
        scored = [k for k, (r, i) in enumerate(items) if r.output(i)]
        for T in sorted({items[k][0].sp["temperature"] or 1.0 for k in scored}):
            group = [k for k in scored if (items[k][0].sp["temperature"] or 1.0) == T]
            if self.score_mode == "exact" or len(group) == 1:
                for k in group:
                    full = torch.tensor(fulls[k], dtype=torch.long, device=self.device)
                    with self._capture(items[k][0].records) as kept:
                        lps[k] = self.score(full, len(items[k][0].prompt), T)
                    recs[k] = self._records(items[k][0].records, kept, [len(full) - 1])[0]
            else:
                self._score_padded([fulls[k] for k in group], [items[k][0] for k in group], T,
                                   [lps, recs], group)
        for k, (r, i) in enumerate(items):   # unscored (no tokens): the records of the prompt alone
            if r.records and recs[k] is None:
                recs[k] = self.prompt_records(torch.tensor(fulls[k], device=self.device), r.records)
        version, answers = self.weight_version, {}   # the version of the weights that scored them
        for k, (r, i) in enumerate(items):
            answers.setdefault(id(r), []).append(self._answer(r.rid, r.t0, r.prompt, r.sp, r.output(i), lps[k],
                                                              r.finish_reason(i), version, recs[k]))
        for r in reqs:
            r.result = answers[id(r)]
        self.finished = self.finished[len(reqs):]

    def _score_padded(self, fulls: list, reqs: list, T: float, into: list, at: list) -> None:
        """Log-probs (and the replay records asked for) of several samples in one forward, right-padded: every
        block is causal (window and compressed entries end at the query, the indexer sees only ended windows, MoE
        and mHC act per token), so padding after a sample changes none of its positions -- but the GEMM shapes
        differ from a batch of one, so the bits may too (module docstring)."""
        L = max(len(f) for f in fulls)
        ids = torch.tensor([f + [0] * (L - len(f)) for f in fulls], device=self.device)            # [N,L]
        names = tuple(n for n in RECORDS if any(n in r.records for r in reqs))
        with self._capture(names) as kept:
            lp = self.model.token_logprobs(ids[:, :-1], ids[:, 1:], temperature=T).tolist()         # [N,L-1]
        recs = self._records(names, kept, [len(f) - 1 for f in fulls])
        for j, (f, r, k) in enumerate(zip(fulls, reqs, at)):
            into[0][k] = lp[j][len(r.prompt) - 1:len(f) - 1]
            into[1][k] = {n: v for n, v in recs[j].items() if n in r.records} if r.records else None

    def _answer(self, rid, t0, prompt, sp, ids, lps, fr, version, records=None) -> dict:
        res = {"output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": fr, "prompt_tokens": len(prompt), "completion_tokens": len(ids),
            "cached_tokens": 0, "weight_version": version, "e2e_latency": time.monotonic() - t0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
        res["meta_info"].update(records or {})
        return res

    def _capture(self, names: tuple):
        """Context for a scoring forward: yields {C4 layer: what its indexer kept} when `names` asks for the
        indexer record (`capture_kept`), else an empty dict."""
        return capture_kept(self.model) if "indexer_topk" in names else contextlib.nullcontext({})

    def _records(self, names: tuple, kept: dict, rows: list) -> list:
        """The replay records `names` of the last forward's N rows, row j cut to its first rows[j] positions ->
        per row {name: base64 int32}. routed_experts from `MoE.last_indices` [N*L,K] -> [N,L,n_layers,K];
        indexer_topk from `kept` -> [N,L,C4 layers,index_topk]."""
        parts = {}
        if "routed_experts" in names:
            layers = self.model.layers
            idx = torch.stack([layers[k].ffn.last_indices for k in sorted(layers, key=int)], 1)  # [N*L,n,K]
            parts["routed_experts"] = idx.view(len(rows), -1, *idx.shape[1:])
        if "indexer_topk" in names and c4_layers(self.cfg):   # none (no C4 layer): no record, as SGLang
            parts["indexer_topk"] = kept_record(kept, self.cfg)
        return [{n: encode_record(t[j, :rows[j]]) for n, t in parts.items()} for j in range(len(rows))]

    @torch.no_grad()
    def prompt_records(self, full: torch.Tensor, names: tuple) -> dict:
        """The replay records `names` of a sample with no tokens: one forward of full[:-1]. full [L]"""
        with self._capture(names) as kept:
            self.model(full[None, :-1])
        return self._records(names, kept, [len(full) - 1])[0]

    def input_logprobs(self, input_ids: list, start: int, temperature: float) -> list:
        """SGLang's `input_token_logprobs` for `logprob_start_len=start`: [[log p(x_i | x_<i), x_i, None] for i
        >= start], the value None at i = start (SGLang 0.5.16 drops it even when start > 0)."""
        full = torch.tensor(input_ids, dtype=torch.long, device=self.device)               # [L]
        lps = [None] + (self.score(full, 1, temperature) if len(input_ids) > 1 else [])    # L values
        vals = [None] + lps[start + 1:]
        return [[lp, t, None] for lp, t in zip(vals, input_ids[start:])]

    @torch.no_grad()
    def score(self, full: torch.Tensor, prompt_len: int, temperature: float) -> list:
        """The trainer's log-probs of full[prompt_len:], batch of one. full [L] -> list of L - prompt_len"""
        with self.lock:
            lp = self.model.token_logprobs(full[None, :-1], full[None, 1:], temperature=temperature or 1.0)
        return lp[0, prompt_len - 1:].tolist()


def encode_record(idx: torch.Tensor) -> str:
    """A replay record as SGLang sends it: base64 of the int32 bytes of idx [positions, layers, K]."""
    return base64.b64encode(idx.to(torch.int32).cpu().contiguous().numpy().tobytes()).decode("ascii")


@contextlib.contextmanager
def capture_kept(model):
    """While active, each C4 layer's indexer records what it kept in its last prefill-shaped forward (its
    `forward`'s first output: the keep mask [B,S,C] bool, or the kernels' index list [B,S,<=K] int32, -1 padded,
    or the replayed record): yields {C4 layer id: that tensor}."""
    out, hooks = {}, []
    for i in c4_layers(model.cfg):
        indexer = model.layers[str(i)].attn.indexer
        assert isinstance(indexer, Indexer), f"layer {i}: compress ratio 4 without an Indexer ({type(indexer)})"
        hooks.append(indexer.register_forward_hook(lambda m, args, res, i=i: out.__setitem__(i, res[0].detach())))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def kept_record(kept: dict, cfg) -> torch.Tensor:
    """SGLang's indexer record from `capture_kept`'s tensors: [B,S,C4 layers,index_topk] int32, each row the
    kept entry indices, highest first, -1 padded (a C4 layer with no entries yet: all -1)."""
    K, rows = cfg.index_topk, []
    for i in c4_layers(cfg):
        keep = kept[i]
        if keep.dtype == torch.bool:   # the mask [B,S,C]: its True columns, at most K of them
            keep = torch.where(keep, torch.arange(keep.shape[-1], device=keep.device), -1)
        keep = keep.to(torch.int32).sort(-1, descending=True).values[..., :K]                       # [B,S,<=K]
        rows.append(torch.nn.functional.pad(keep, (0, K - keep.shape[-1]), value=-1))               # [B,S,K]
    return torch.stack(rows, 2)


@dataclass(eq=False)   # identity: a request is "in" the batch, not an equal one
class Request:
    """One prompt in flight with its n samples: n rows of the batch from its first step to its last (a sample
    that stopped keeps its row until the request ends, so the request's generator draws for n rows each step,
    as when it decoded alone). Tokens are kept on the host."""
    rid: str
    t0: float
    prompt: list
    sp: dict
    records: tuple                     # replay records asked for (RECORDS)
    gen: torch.Generator
    out: list                          # per sample: the ids drawn so far
    done: list                         # per sample: None, or (ids up to and with the stop id, the stop id)
    reason: str = "length"             # "abort" once aborted
    gathered: bool = False             # its thread, as driver, waited for the others before a new batch
    result: Optional[list] = None
    error: Optional[BaseException] = None

    @property
    def n(self) -> int:
        return len(self.out)

    @property
    def length(self) -> int:
        """Tokens of each row so far (prompt + drawn)."""
        return len(self.prompt) + len(self.out[0])

    def decoded(self) -> bool:
        return all(d is not None for d in self.done) or len(self.out[0]) >= self.sp["max_new_tokens"]

    def output(self, i: int) -> list:
        """Sample i's ids, cut after its stop id."""
        return self.out[i][:self.done[i][0]] if self.done[i] else self.out[i]

    def finish_reason(self, i: int) -> dict:
        if self.done[i]:
            return {"type": "stop", "matched": self.done[i][1]}
        if self.reason == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "length", "length": self.sp["max_new_tokens"]}

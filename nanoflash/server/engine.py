"""The embedded rollout engine: nanoflash's own inference behind the SGLang-protocol server (`server.py`).

Generation, per request (one prompt, n samples decoded together as a batch of n):

    prefill the prompt, then repeat: logits_t -> sample -> append, until a stop id or max_new_tokens
    sample:  p = softmax(logits / T), keep the top-k, keep the smallest set with cumulative p >= top_p,
             renormalise, draw (T = 0: argmax)
    score:   logprob_t = log_softmax(logits / T)[token_t]  -- recomputed at the end by the trainer's own
             `model.token_logprobs` on each finished sequence (batch of one), so the log-probs equal the
             trainer's bit for bit ("true on-policy"; T = 0 is scored at T = 1). Cost: one extra forward of
             the whole sequence per sample, on top of decoding.

Routing replay (R3): with `return_routed_experts` the result carries, in SGLang's format (base64 int32
[prompt + output - 1, n_layers, top-k]), the experts every MoE layer chose in that same scoring forward --
exactly the routing a trainer forward on the same tokens and weights computes.

Decoding uses the model's incremental cache (`model.new_cache()`, `model(ids, start_pos, cache)`) when a
start-up self-check finds it agrees with the full forward, else re-runs the full forward every step
(`decode="auto"|"cache"|"full"`). Requests wait at step boundaries while generation is paused
(`in_place`/`retract`; `abort` ends them); a weight update bumps `epoch`, and a cached request re-prefills
(SGLang's "retract": recompute from scratch rather than keep stale KV).

Weights: the engine keeps what was pushed in SGLang's loader layout (`layout.LoaderState`) and derives the
model's parameters from it in `post_process()` -- unfuse pairs, un-permute `ape`, dequantize FP8 blocks,
int32 `tid2eid` -> int64. Modes: "fp32"/"bf16" run the model in that dtype; "fp8" runs on the dequantized
e4m3 weights (what an FP8 engine computes with, minus its activation quantization). Cost: the pushed layout
is kept next to the model's parameters (about 2x weight memory; fine for tiny/small, not for flash). `post_process` runs
after every update call (stock protocol) or at `end_weight_update` / `post_process_weights`; until then the
model still runs the old derived weights, which the checksum of the derived state (`derived_checksum`, on
`/weights_checker` when asked) shows.

Tests: `pytest tests/test_rollout_server.py -q`.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import math
import threading
import time
import uuid

import torch

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
SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                 "min_new_tokens", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens",
                 "ignore_eos", "stop"}
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


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


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen: torch.Generator):
    """Draw one token per row. logits [B,V] fp32 -> ids [B]. Non-finite logits are an error naming the cause
    (broken served weights, e.g. a diverged update), never a silent draw."""
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("non-finite logits: the served weights are broken (NaN/inf or overflowing, "
                                 "e.g. a diverged update)")
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
    """nanoflash inference + SGLang-layout weight store. Thread-safe: one forward at a time (`lock`)."""

    def __init__(self, model, weights: str = "fp32", decode: str = "auto", seed: int = 0,
                 max_running: int = DEFAULT_MAX_RUNNING):
        if weights not in WEIGHT_DTYPES:
            raise ValueError(f"weights must be one of {sorted(WEIGHT_DTYPES)}, got {weights!r}")
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
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
        self.store = LoaderState()
        fp8 = weights == "fp8"
        for bucket in iter_sglang_buckets(model, fp8=fp8, bucket_bytes=1 << 62):
            self.store.load(bucket)
        self.store.freeze()
        self.post_process()
        self.use_cache = decode == "cache" or (decode == "auto" and self._cache_agrees())

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
    def _cache_agrees(self) -> bool:
        ids = torch.arange(1, 10, device=self.device)[None] % self.cfg.vocab_size   # [1,9]
        try:
            with torch.no_grad(), self.lock:
                full = self.model(ids)[0, -1]
                cache = self.model.new_cache()
                self.model(ids[:, :-1], 0, cache)
                step = self.model(ids[:, -1:], ids.shape[1] - 1, cache)[0, -1]
        except Exception:  # an incomplete cache implementation: fall back to full forwards
            return False
        tol = CACHE_CHECK_ATOL.get(self.model.embed.weight.dtype, 5e-2)
        return bool((full - step).abs().max() <= tol)

    def _next_logits(self, seqs: torch.Tensor, state: dict) -> torch.Tensor:
        """Logits of the next token for every row. seqs [n,L] -> [n,V] fp32"""
        if not self.use_cache:
            return self.model(seqs)[:, -1]
        if state.get("epoch") != self.epoch or "cache" not in state:   # first step or weights changed
            state.update(cache=self.model.new_cache(), epoch=self.epoch)
            return self.model(seqs, 0, state["cache"])[:, -1]
        return self.model(seqs[:, -1:], seqs.shape[1] - 1, state["cache"])[:, -1]

    def _wait(self, rid: str, t0: float) -> bool:
        """Block while paused; False if this request was aborted."""
        while self.paused and t0 >= self.abort_all_before and rid not in self.aborted:
            self.resume.wait(timeout=0.5)
        return t0 >= self.abort_all_before and rid not in self.aborted

    def _wait_to_score(self, rid: str, t0: float) -> bool:
        """Scoring waits out a pause like a decode step (a push may be half applied); False if the request is
        aborted while it waits. An abort outside a pause does not stop scoring (the partial sample is scored)."""
        while self.paused:
            if t0 < self.abort_all_before or rid in self.aborted:
                return False
            self.resume.wait(timeout=0.5)
        return True

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
    def generate(self, input_ids: list, sp: dict, rid: str | None = None, routed: bool = False) -> list:
        """One prompt, `sp['n']` samples -> SGLang-shaped result dicts."""
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
                empty = torch.tensor([], dtype=torch.long, device=self.device)
                return [self._finish(input_ids, empty, None, "abort", sp, rid, t0, False, queued=True)
                        for _ in range(n)]
            try:
                return self._generate(input_ids, sp, rid, t0, routed)
            finally:
                self._release(n)
        finally:
            with self.lock:
                self.inflight[rid] -= 1
                if not self.inflight[rid]:
                    del self.inflight[rid]
                    self.aborted.discard(rid)

    def _generate(self, input_ids: list, sp: dict, rid: str, t0: float, routed: bool) -> list:
        n, stops = sp["n"], set(sp["stop_token_ids"])
        with self.lock:
            seed = sp["seed"] if sp["seed"] is not None else int(torch.randint(0, 2**62, (1,), generator=self.seed_gen))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        seqs = torch.tensor([input_ids] * n, dtype=torch.long, device=self.device)   # [n,P]
        done, reason, state = [None] * n, "length", {}
        for _ in range(sp["max_new_tokens"]):
            with self.lock:
                if not self._wait(rid, t0):
                    reason = "abort"
                    break
                logits = self._next_logits(seqs, state)
            nxt = sample(logits, sp["temperature"], sp["top_p"], sp["top_k"], gen)
            seqs = torch.cat([seqs, nxt[:, None]], 1)                                  # [n,L+1]
            for i in range(n):
                if done[i] is None and int(nxt[i]) in stops:
                    done[i] = (seqs.shape[1] - len(input_ids), int(nxt[i]))
            if all(d is not None for d in done):
                break
        return [self._finish(input_ids, seqs[i], done[i], reason, sp, rid, t0, routed) for i in range(n)]

    def _finish(self, prompt, seq, stopped, reason, sp, rid, t0, routed=False, queued=False) -> dict:
        out = seq if queued else seq[len(prompt):stopped[0] + len(prompt)] if stopped else seq[len(prompt):]
        with self.lock:  # the routing record must come from this very scoring forward
            if not queued and not self._wait_to_score(rid, t0):   # aborted during a push: cannot be scored
                out, stopped, reason = out[:0], None, "abort"
            full = torch.cat([torch.tensor(prompt, dtype=torch.long, device=out.device), out])
            lps = self.score(full, len(prompt), sp["temperature"]) if len(out) else []
            routes = self.routed_experts(full, scored=len(out) > 0) if routed else None
            version = self.weight_version  # of the weights that scored it
        fr = ({"type": "stop", "matched": stopped[1]} if stopped else
              {"type": "abort", "message": "Abort in waiting queue" if queued else "aborted"} if reason == "abort" else
              {"type": "length", "length": sp["max_new_tokens"]})
        ids = out.tolist()
        res = {"output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": fr, "prompt_tokens": len(prompt), "completion_tokens": len(ids),
            "cached_tokens": 0, "weight_version": version, "e2e_latency": time.monotonic() - t0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
        if routes is not None:
            res["meta_info"]["routed_experts"] = routes
        return res

    @torch.no_grad()
    def routed_experts(self, full: torch.Tensor, scored: bool) -> str:
        """R3 record in SGLang's format: base64 of int32 [len(full) - 1, n_layers, top-k], the experts every
        MoE layer chose for each input position of the scoring forward (`MoE.last_indices`)."""
        if not scored:
            self.model(full[None, :-1])
        layers = self.model.layers
        idx = torch.stack([layers[k].ffn.last_indices for k in sorted(layers, key=int)], 1)  # [L-1,n_layers,K]
        return base64.b64encode(idx.to(torch.int32).cpu().contiguous().numpy().tobytes()).decode("ascii")

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

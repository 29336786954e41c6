"""HTTP client for SGLang's rollout protocol (real SGLang or nanoflash's embedded server, it cannot tell).

What it speaks (request/response shapes of SGLang 0.5.16, `docs/rl_notes.md` §4 and
`shared/docs/sglang_on_h200.md`):

    POST /generate {"input_ids": [...], "sampling_params": {"n", "temperature", "top_p", "max_new_tokens",
                    "stop_token_ids"}, "return_logprob": true, "return_routed_experts": false}
      -> {"output_ids": [...], "meta_info": {"output_token_logprobs": [[logprob, token_id, null], ...],
          "finish_reason": {"type": "stop"|"length"|"abort", ...}, "weight_version": "7",
          "routed_experts": base64 int32 [prompt + output - 1, n_layers, top-k] (R3; if asked), ...}}
         (a list of such dicts when n > 1 or the input is a batch)
    GET  /health                       200 once the engine can serve
    POST /pause_generation {"mode"}    POST /continue_generation {}    GET /flush_cache
    POST /abort_request {"abort_all": true}
    POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /destroy_weights_update_group {group_name}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version,
                                           load_format: "flattened_bucket" (optional: one flat uint8 broadcast)}
    GET  /server_info -> {tp_size, dp_size, pp_size, enable_dp_attention, version, max_running_requests,
                          internal_states: [{effective_max_running_requests_per_dp}, ...], ...}: a group's
                          world size, and how many sequences the server runs at once (`capacity`)
    POST /update_weights_from_tensor {serialized_named_tensors: [one per TP rank], load_format, ...}
    POST /update_weights_from_disk {model_path, load_format, weight_version}
    POST /weights_checker {"action": "checksum"} -> {"success", "message", "ranks": [{"checksums": {...}}]}

Protocol generations (how weight updates are bracketed), detected without side effects from the route list
(`GET /openapi.json`, which SGLang's FastAPI app serves unless DISABLE_OPENAPI_DOC) or else from the version
(`GET /server_info`, formerly `/get_server_info`). Pinned from the sglang 0.5.16 and 0.5.23 wheels'
`srt/entrypoints/http_server.py`: 0.5.16 has no begin/end/post_process routes, 0.5.23 has
`/begin_weight_update` and `/end_weight_update`, and its scheduler refuses an update outside that session:

    "stock"        SGLang 0.5.16: no bracket calls (begin/end/post_process all 404)
    "post_process" sglang-miles before 2026-06: POST /post_process_weights before (restore) and after (quantize)
    "session"      PR #28001 and sglang >= 0.5.23: POST /begin_weight_update ... POST /end_weight_update

Robustness: a connection that fails before the request is sent is retried with exponential backoff
(`retry_s` in total); a server that stays unreachable raises `ServerGoneError` naming it. A POST that was sent is
never re-sent: no answer (read timeout: `timeout`, `update_timeout` for weight updates) raises
`RequestUnanswered`, and a `/generate` left so is aborted by its rid (`/abort_request {"rid"}`). HTTP 4xx
raises `RequestRejected` at once (never retried; `.too_long`: a prompt over the context length).
`api_key`: `Authorization: Bearer KEY` on every request.
`generate` without a `url` goes to the server with the fewest requests in flight (the loop's thread pool spreads).

Differences from production (Miles' `SGLangEngine`): synchronous threads, not asyncio; no router; pushing to
real SGLang by `update_weights_from_tensor` needs SGLang (its pickled CUDA-IPC payload; the embedded server
takes safetensors: it never unpickles network bytes).

Tests: `pytest tests/test_rollout_client.py tests/test_rollout_server.py tests/test_rollout_http_limits.py -q`."""
from __future__ import annotations

import base64
import http.client
import json
import random
import re
import socket
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

# The first SGLang release with /begin_weight_update and /end_weight_update (rl_notes §4.7).
SESSION_MIN_VERSION = (0, 5, 23)
# The first release whose update_weights_from_distributed takes load_format="flattened_bucket" that we pinned.
FLAT_MIN_VERSION = (0, 5, 16)
# Weight-update calls return when the server has loaded (a distributed one: after the whole broadcast of the
# bucket, on every TP rank); a 1 GiB bucket of a cold SGLang, or a group join waiting for every rank, outlasts
# the 600 s that bounds a /generate. Their own default; RolloutConfig.update_timeout_s overrides it.
UPDATE_TIMEOUT_S = 3600.0
# An abort is answered at once (SGLang queues it); a server that cannot answer that fast is gone anyway.
ABORT_TIMEOUT_S = 10.0
UPDATE_PATHS = frozenset({"/init_weights_update_group", "/update_weights_from_distributed",
                          "/update_weights_from_tensor", "/update_weights_from_disk", "/begin_weight_update",
                          "/end_weight_update", "/post_process_weights"})


class ServerGoneError(ConnectionError):
    """A server stayed unreachable through every retry."""


class RequestUnanswered(ServerGoneError):
    """A request was sent and no answer came (timeout, or the connection dropped after the send). A POST is never
    re-sent: the server may be running it (a second /generate samples twice, a second weight update loads a
    bucket whose broadcast never comes)."""


class _NotSent(Exception):
    """The connection failed before any byte of the request left (refused, unreachable): safe to retry."""


class RequestRejected(RuntimeError):
    """The server answered 4xx/5xx: the request itself is wrong (or the server refused it)."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message

    @property
    def too_long(self) -> bool:
        """A 400 for a prompt over the context length (SGLang: "... the model's context length ...")."""
        return self.status == 400 and "context length" in self.message.lower()


@dataclass
class Generation:
    """One sampled completion: ids, per-token log-probs of the sampled tokens, why it stopped."""

    prompt_ids: list
    output_ids: list
    logprobs: list                  # float per output token (log p of the sampled token, temperature-scaled)
    finish_reason: str              # "stop" | "length" | "abort"
    weight_version: str | None = None
    server: str = ""
    meta_info: dict = field(default_factory=dict)


def parse_generation(item: dict, prompt_ids: list, server: str) -> Generation:
    """Turn one SGLang `/generate` result dict into a `Generation`, with errors naming the bad field."""
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"{server}: /generate result has no meta_info dict: {str(item)[:200]}")
    lps = meta.get("output_token_logprobs")
    ids = item.get("output_ids")
    if ids is None and lps is not None:
        ids = [int(t[1]) for t in lps]
    if ids is None:
        raise ValueError(f"{server}: /generate result has neither output_ids nor output_token_logprobs")
    if lps is not None and len(lps) != len(ids):
        raise ValueError(f"{server}: {len(lps)} log-probs for {len(ids)} output ids")
    if lps is not None and [int(t[1]) for t in lps] != [int(t) for t in ids]:
        raise ValueError(f"{server}: output_token_logprobs token ids disagree with output_ids")
    if lps is not None and any(t[0] is None for t in lps):  # JSON null: non-finite on the server
        raise ValueError(f"{server}: output_token_logprobs holds null (non-finite) log-probs: {str(lps)[:120]}")
    fr = meta.get("finish_reason") or {}
    reason = fr.get("type", "") if isinstance(fr, dict) else str(fr)
    return Generation(prompt_ids=list(prompt_ids), output_ids=[int(t) for t in ids],
                      logprobs=[float(t[0]) for t in lps] if lps is not None else [],
                      finish_reason=reason, weight_version=meta.get("weight_version"), server=server,
                      meta_info=meta)


def decode_routed_experts(meta_info: dict, n_layers: int, topk: int):
    """SGLang's R3 record (`return_routed_experts`): base64 int32 -> int64 tensor [tokens - 1, n_layers, topk]."""
    return _decode_record(meta_info, "routed_experts", n_layers, topk)


def decode_indexer_topk(meta_info: dict, n_layers: int, topk: int):
    """SGLang's indexer record (`return_indexer_topk`, 0.5.16 `state_capturer/indexer_topk.py`): base64 int32
    -> int64 tensor [tokens - 1, n_layers, topk], row t the C4 entries query t kept (-1 padded), layer j the
    model's j-th C4 layer (`compress_layer_id`, counted over C4 layers alone: `mem_cache/deepseek_v4_memory_pool.py`
    L959). Query t sees (t + 1) // 4 entries, the rule `model.visible_entries` has: the indexer is given
    `c4_topk_lengths_raw` (`layers/attention/deepseek_v4_backend.py` L652) = seq_len // 4 with seq_len = t + 1,
    not the clamped-to-1 length flash_mla reads (`kernels/ops/attention/dsv4/metadata_kernel.py` L41-42), and
    its top-k marks every entry at or past that length -1 (`layers/attention/dsv4/indexer.py` L248-326, the
    torch reference of the CUDA `topk_transform_512`): queries 0-2 keep nothing."""
    return _decode_record(meta_info, "indexer_topk", n_layers, topk)


def _decode_record(meta_info: dict, key: str, n_layers: int, topk: int):
    """A per-position record of meta_info[key] (base64 int32) -> int64 [tokens - 1, n_layers, topk]."""
    import numpy as np
    import torch
    raw = base64.b64decode(meta_info[key], validate=True)
    arr = np.frombuffer(raw, dtype=np.int32)
    if arr.size % (n_layers * topk):
        raise ValueError(f"{key} holds {arr.size} ids, not a multiple of layers x top-k = {n_layers * topk}")
    return torch.from_numpy(arr.copy()).to(torch.int64).view(-1, n_layers, topk)  # [T-1,n_layers,K]


def parse_version(v: str) -> tuple:
    """'0.5.16.post1' -> (0, 5, 16); unparsable -> ()."""
    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", str(v))
    return tuple(int(x) for x in m.groups()) if m else ()


def protocol_from_routes(paths) -> str:
    """The weight-update generation a server speaks, from its route list."""
    paths = set(paths)
    if "/begin_weight_update" in paths and "/end_weight_update" in paths:
        return "session"
    if "/post_process_weights" in paths:
        return "post_process"
    return "stock"


class SGLangClient:
    """Talks to one or more SGLang-protocol servers (`urls`), with retries, spreading and fail-over."""

    def __init__(self, urls, api_key: str | None = None, timeout: float = 600.0, retry_s: float = 30.0,
                 backoff_s: float = 0.1, max_backoff_s: float = 4.0, update_timeout: float = UPDATE_TIMEOUT_S):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("SGLangClient needs at least one server url")
        self.api_key, self.timeout, self.retry_s = api_key, timeout, retry_s
        self.update_timeout = update_timeout      # the read timeout of UPDATE_PATHS (`timeout`: every other call)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._inflight = {u: 0 for u in self.urls}
        self._lock = threading.Lock()
        self._protocols: dict = {}
        self._embedded: dict = {}
        self._info: dict = {}
        self.weight_version = 0           # bumped by every transports.push_weights

    # ------------------------------------------------------------------ transport
    def request(self, url: str, method: str, path: str, body=None, timeout: float | None = None,
                retry_s: float | None = None):
        """One HTTP call with JSON in and out. A connection that fails before the request is sent is retried with
        backoff until `retry_s`; after the send, a GET is retried the same way, a POST never (RequestUnanswered).
        `timeout`: the read timeout (default: `update_timeout` for UPDATE_PATHS, else `timeout`)."""
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        delay, attempt = self.backoff_s, 0
        timeout = timeout or (self.update_timeout if path in UPDATE_PATHS else self.timeout)
        while True:
            attempt += 1
            try:
                return self._once(url, method, path, body, timeout)
            except (_NotSent, ConnectionError, socket.timeout, OSError, http.client.HTTPException) as e:
                if method != "GET" and not isinstance(e, _NotSent):
                    raise RequestUnanswered(f"{url}{path}: sent, then {type(e).__name__}: {e} (read timeout "
                                            f"{timeout:g}s); not re-sent") from e
                if isinstance(e, _NotSent):
                    e = e.__cause__ or e
                if isinstance(e, ServerGoneError) or time.monotonic() + delay > deadline:
                    raise ServerGoneError(f"{url}{path}: server unreachable after {attempt} attempt(s) "
                                          f"over {self.retry_s if retry_s is None else retry_s:.1f}s: "
                                          f"{type(e).__name__}: {e}") from e
                time.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, self.max_backoff_s)

    def _once(self, url: str, method: str, path: str, body, timeout: float):
        u = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        try:
            try:
                conn.connect()   # nothing sent yet: a failure here is the only one a POST may retry
            except OSError as e:
                raise _NotSent(f"{type(e).__name__}: {e}") from e
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        text = raw.decode(errors="replace")
        if resp.status >= 400:
            try:
                msg = json.loads(text)
                msg = msg.get("error", msg.get("message", msg)) if isinstance(msg, dict) else msg
                msg = msg.get("message", msg) if isinstance(msg, dict) else msg
            except json.JSONDecodeError:
                msg = text[:500]
            raise RequestRejected(url + path, resp.status, str(msg))
        if not text:
            return {}
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}

    def post(self, url: str, path: str, body=None, **kw):
        return self.request(url, "POST", path, body if body is not None else {}, **kw)

    def get(self, url: str, path: str, **kw):
        return self.request(url, "GET", path, **kw)

    def broadcast(self, path: str, body=None, method: str = "POST") -> list:
        """The same call on every server, in order; returns the answers."""
        return [self.request(u, method, path, body if method == "POST" else None) for u in self.urls]

    # ------------------------------------------------------------------ health / control
    def health(self, url: str) -> bool:
        try:
            self.get(url, "/health", timeout=5.0, retry_s=0.0)
            return True
        except (ServerGoneError, RequestRejected):
            return False

    def wait_healthy(self, timeout: float = 120.0):
        """Block until every server answers /health, or raise naming the ones that do not."""
        deadline = time.monotonic() + timeout
        pending = list(self.urls)
        while pending and time.monotonic() < deadline:
            pending = [u for u in pending if not self.health(u)]
            if pending:
                time.sleep(0.1)
        if pending:
            raise ServerGoneError(f"servers not healthy after {timeout}s: {pending}")

    def pause_generation(self, mode: str = "retract"):
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r} not in abort|retract|in_place")
        return self.broadcast("/pause_generation", {"mode": mode})

    def continue_generation(self):
        return self.broadcast("/continue_generation", {})

    def flush_cache(self):
        return self.broadcast("/flush_cache", method="GET")

    def abort(self, url: str, rid: str) -> bool:
        """`POST /abort_request {"rid"}` (SGLang 0.5.16 `AbortReq`), best effort; -> whether the server took it."""
        try:
            self.post(url, "/abort_request", {"rid": rid}, timeout=ABORT_TIMEOUT_S, retry_s=0.0)
            return True
        except (ServerGoneError, RequestRejected):
            return False

    def abort_all(self, timeout: float = ABORT_TIMEOUT_S) -> list:
        """Abort every request in flight on every server (Ctrl-C, dynamic sampling's over-sampling tail), best
        effort: each server gets `timeout` seconds and no retry. -> [whether each server took it]. SGLang 0.5.16
        (`Scheduler.abort_request`) ends a queued request at once with no tokens and a running one after one more
        decode step, answering its /generate with finish_reason "abort" and the tokens (and log-probs) it had."""
        out = []
        for u in self.urls:
            try:
                self.post(u, "/abort_request", {"abort_all": True}, timeout=timeout, retry_s=0.0)
                out.append(True)
            except (ServerGoneError, RequestRejected):
                out.append(False)
        return out

    # ------------------------------------------------------------------ protocol detection
    def protocol(self, url: str) -> str:
        """'stock' | 'post_process' | 'session', from routes (GET /openapi.json) or version; never a POST."""
        if url not in self._protocols:
            try:
                spec = self.get(url, "/openapi.json")
                self._protocols[url] = protocol_from_routes(spec.get("paths", {}))
            except RequestRejected:
                try:
                    info = self.get(url, "/server_info")
                except RequestRejected:  # older name, deprecated in 0.5.16
                    info = self.get(url, "/get_server_info")
                ver = parse_version(info.get("version", ""))
                if not ver:
                    raise ValueError(f"{url}: no route list and no parsable version in /get_server_info "
                                     f"(got {info.get('version')!r}); cannot tell the weight-update protocol")
                self._protocols[url] = "session" if ver >= SESSION_MIN_VERSION else "stock"
        return self._protocols[url]

    def server_info(self, url: str) -> dict:
        """`GET /server_info` (0.5.16; `/get_server_info` before), cached per server until `forget(url)`."""
        if url not in self._info:
            try:
                self._info[url] = self.get(url, "/server_info")
            except RequestRejected:  # older name, deprecated in 0.5.16
                self._info[url] = self.get(url, "/get_server_info")
        return self._info[url]

    def max_running(self, url: str) -> int | None:
        """Sequences the server runs at once, as its `/server_info` says. SGLang 0.5.16 answers with its
        ServerArgs (`max_running_requests`: None unless set, `dp_size`) and one `internal_states` entry per DP
        rank, each with `effective_max_running_requests_per_dp` (`Scheduler.get_internal_state`,
        srt/managers/scheduler.py; the value the scheduler derived from its KV pool, or the flag): their sum,
        else max_running_requests x dp_size, else None (the server does not say)."""
        info = self.server_info(url)
        per_dp = [s.get("effective_max_running_requests_per_dp") for s in info.get("internal_states") or []
                  if isinstance(s, dict)]
        if per_dp and all(isinstance(v, int) and v > 0 for v in per_dp):
            return sum(per_dp)
        flag = info.get("max_running_requests")
        return int(flag) * int(info.get("dp_size") or 1) if isinstance(flag, int) and flag > 0 else None

    def capacity(self) -> int | None:
        """Sequences all servers run at once (`max_running` summed); None if any server does not say."""
        caps = [self.max_running(u) for u in self.urls]
        return None if any(c is None for c in caps) else sum(caps)

    def forget(self, url: str) -> None:
        """Drop what was learnt about a server (it restarted: re-read its info before the next push)."""
        for cache in (self._info, self._embedded, self._protocols):
            cache.pop(url, None)

    def server_ranks(self, url: str) -> int:
        """Ranks this server joins into a weight-update group: SGLang 0.5.16 joins each scheduler as
        `rank_offset + tp_rank` (`model_runner_components/weight_updater.py`), so a server brings tp_size ranks
        (with DP attention its DP ranks are TP ranks). Replicas that would reuse a tp_rank (pp_size > 1, or
        dp_size > 1 without DP attention) cannot join one group; that server is refused by name."""
        info = self.server_info(url)
        tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
        if pp > 1 or (dp > 1 and not info.get("enable_dp_attention")):
            raise ValueError(f"{url}: tp_size={tp} dp_size={dp} pp_size={pp}: SGLang joins a weight-update group "
                             f"as rank_offset + tp_rank, so its {dp * pp} replicas would collide; serve one "
                             "replica per server (or DP attention) for update_weights_from_distributed")
        return tp

    def supports_flattened(self, url: str) -> bool:
        """Does `/update_weights_from_distributed` take load_format="flattened_bucket" (one flat broadcast per
        bucket)? The embedded server does, and SGLang since 0.5.16 (`_update_bucketed_weights_from_distributed`)."""
        info = self.server_info(url)
        return info.get("engine") == "nanoflash" or parse_version(info.get("version", "")) >= FLAT_MIN_VERSION

    def is_embedded(self, url: str) -> bool:
        """Is this nanoflash's embedded server (safe tensor payloads) rather than real SGLang (pickles)?"""
        if url not in self._embedded:
            self._embedded[url] = self.get(url, "/get_server_info").get("engine") == "nanoflash"
        return self._embedded[url]

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids: list, sampling_params: dict, return_logprob: bool = True,
                 url: str | None = None, retry_s: float | None = None, return_routed_experts: bool = False,
                 return_indexer_topk: bool = False) -> list:
        """Sample `sampling_params['n']` (default 1) completions of one prompt; a list of `Generation`."""
        if not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise ValueError(f"input_ids must be a non-empty list of ints, got {str(input_ids)[:80]}")
        url = url or self._pick()
        rid = uuid.uuid4().hex  # names the request, so that one left without an answer can be aborted
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "return_logprob": return_logprob, "rid": rid}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if return_indexer_topk:
            body["return_indexer_topk"] = True
        with self._lock:
            self._inflight[url] += 1
        try:
            out = self.post(url, "/generate", body, retry_s=retry_s)
        except RequestUnanswered:
            # the server may still be sampling it: stop it (never sample it twice). SGLang 0.5.16 names the n > 1
            # samples "{rid}_{i}" (io_struct `_normalize_rid`) and its tokenizer ignores an abort of an rid it
            # does not hold, so each is named too.
            n = int(sampling_params.get("n", 1) or 1)
            for r in [rid] + ([f"{rid}_{i}" for i in range(n)] if n > 1 else []):
                self.abort(url, r)
            raise
        finally:
            with self._lock:
                self._inflight[url] -= 1
        items = out if isinstance(out, list) else [out]
        return [parse_generation(it, input_ids, url) for it in items]

    def _pick(self) -> str:
        """The server with the fewest requests in flight (the first such on a tie)."""
        with self._lock:
            return min(self.urls, key=lambda u: self._inflight[u])

    # ------------------------------------------------------------------ weight updates
    def begin_update(self, url: str):
        """Open a weight update the way this server's generation wants it."""
        proto = self.protocol(url)
        if proto == "session":
            self.post(url, "/begin_weight_update", {"selector": "all"})
        elif proto == "post_process":
            self.post(url, "/post_process_weights", {"restore_weights_before_load": True})

    def end_update(self, url: str):
        """Close it: re-derive quantization state (`end_weight_update` / `post_process_weights`)."""
        proto = self.protocol(url)
        if proto == "session":
            self.post(url, "/end_weight_update", {})
        elif proto == "post_process":
            self.post(url, "/post_process_weights", {"post_process_quantization": True})

    def update_weight_version(self, version: str):
        return self.broadcast("/update_weight_version", {"new_version": str(version),
                                                         "abort_all_requests": False})

    def weights_checksums(self, url: str) -> dict:
        """`/weights_checker {"action": "checksum"}` -> {internal name: sha256 hex}, merged over the ranks."""
        return {n: h for r in self.weights_checksums_per_rank(url) for n, h in r.items()}

    def weights_checksums_per_rank(self, url: str) -> list:
        """`/weights_checker` checksums of each of the server's ranks: [{internal name: hex}, ...]."""
        out = self.post(url, "/weights_checker", {"action": "checksum"})
        if not out.get("success", False) or not out.get("ranks"):
            raise RuntimeError(f"{url}/weights_checker gave no checksums: {str(out)[:300]}")
        return [dict(r.get("checksums", {})) for r in out["ranks"]]

    def init_weights_update_group(self, url: str, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str):
        return self.post(url, "/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    def update_weights_from_disk(self, url: str, model_path: str, weight_version: str | None,
                                 load_format: str | None = None):
        body = {"model_path": model_path}
        if weight_version is not None:  # None: the server keeps reporting its version (bumped after a push)
            body["weight_version"] = str(weight_version)
        if load_format:
            body["load_format"] = load_format
        return self.post(url, "/update_weights_from_disk", body)

"""nanoflash's embedded rollout server: the subset of SGLang's HTTP API that RL needs, same shapes.

    python -m nanoflash.server --preset tiny --port 30000 [--weights fp32|bf16|fp8]
        [--protocol stock|post_process|session] [--api-key KEY] [--checkpoint DIR] [--host 127.0.0.1]
        [--disk-root DIR] [--group-hosts HOST,...] [--read-timeout S] [--max-connections N] [--max-trace-bytes B]
        [--max-running-requests N] [--batching continuous|serial] [--score auto|exact|batched]

SGLang's launch flags are accepted too, so a rehearsal starts it with SGLang's command line (`python -m
nanoflash.server` in place of `python3 -m sglang.launch_server`, the rest unchanged; `tests/test_rehearsal.py`
runs docs/demo.md's four-node commands that way):

    --model-path DIR    = --checkpoint DIR, served in FP8 (--weights fp8 unless given), as SGLang serves it
    --tp N              = --tp-size N: ranks joined into a weight-update group (SGLang's TP ranks)
    --skip-tokenizer-init, --enable-return-routed-experts   what this server always does (token ids in and out;
                                                            R3 records on request)
    --mem-fraction-static F   SGLang's static KV pool share; this engine has none (its cache is per request)

Routes (JSON in, JSON out; see `client.py` for the request/response shapes):

    GET  /health /health_generate /server_info /get_server_info /get_model_info /get_weight_version /openapi.json
    POST /generate /abort_request
    POST /pause_generation /continue_generation, GET|POST /flush_cache                 (admin)
    POST /update_weights_from_tensor /update_weights_from_disk /init_weights_update_group
         /destroy_weights_update_group /update_weights_from_distributed /update_weight_version
         /weights_checker                                                              (admin)
    POST /nanoflash/trace                                (nanoflash only: activations, server/trace.py)
    POST /begin_weight_update /end_weight_update        (protocol "session" only)
    POST /post_process_weights                           (protocol "post_process" only)

`--protocol` picks which weight-update generation the server emulates; `/openapi.json` lists exactly the routes
it serves, which is how the client tells the generations apart. Under "session" an update outside
begin/end is refused (SGLang >= PR #28001 asserts the same). Post-load processing (`engine.post_process`)
runs after each update under "stock", at `post_process_weights(post_process_quantization)` under
"post_process", and at `end_weight_update` under "session".

Safety: binds 127.0.0.1 by default; with `--api-key` every route but /health and /health_generate needs
`Authorization: Bearer KEY` (401 otherwise; SGLang exempts the same two). The HTTP layer is bounded
(`http_guard.py`: read deadlines, a connection cap, per-route body limits); one /generate asks for at most
`max_request_tokens` = prompts x n x max_new_tokens (default MAX_N x the model's max_seq_len: one full-length
request of the largest n); `/update_weights_from_disk` reads only below `--disk-root` and
`/init_weights_update_group` joins only groups at `--group-hosts` with bounded ranks and timeout
(`update_guard.py`); `/nanoflash/trace` takes at most max_seq_len ids and answers at most `--max-trace-bytes`
(413 past it), and on a server without a key only loopback clients (403 otherwise: `server/trace.py`).
`/update_weights_from_tensor` accepts only
`load_format="nanoflash_safetensors"` (base64 safetensors) -- SGLang's own payload is a pickle of CUDA-IPC
handles, and this server never unpickles network bytes (400) -- or, from the trainer in the server's own
process, `"nanoflash_in_process"` with a handle to tensors it parked (`buckets.hand_over`: no bytes on the wire,
the GPU tensors as they are; a handle this process never parked is a 400). `/weights_checker` adds the hash
of the weights the model runs with (`derived_checksum`: every parameter in fp32, costly) only when asked
(`"derived": true`). Any malformed request gets 400 with a message
naming the problem; an unexpected failure gets 500; the server keeps serving either way. `/health_generate`
runs one greedy token and answers 503 naming the failure when it cannot (e.g. NaN weights).

Scheduling as SGLang does it, as far as RL sees it: at most `--max-running-requests` sequences decode at once
(a request of n samples takes n; /server_info reports the number as SGLang 0.5.16 does, `max_running_requests`
and `internal_states[i].effective_max_running_requests_per_dp`), the others wait in a queue. `/abort_request`
(`rid`, or `abort_all`) ends a queued request at once with no tokens ("Abort in waiting queue") and a running
one at its next decode step with the tokens it has, scored; `/pause_generation` holds every request at its next
step (`in_place`, `retract`) or aborts them all and returns once none runs (`abort`); `/continue_generation`
releases them.

Differences from SGLang: stdlib `ThreadingHTTPServer` instead of FastAPI/uvicorn (no new dependencies);
one forward at a time (every running request in it: continuous batching, engine.py); the prompts of one batched
/generate run one after another; no radix cache (`flush_cache` is a no-op that succeeds); no tokenizer (token
ids only); an aborted running request stops before its next decode step (SGLang runs one more).

Tests: `pytest tests/test_rollout_server.py tests/test_rollout_http_limits.py -q`.
"""
from __future__ import annotations

import argparse
import threading

import torch

from nanoflash.checkpoint import load_hf_checkpoint
from nanoflash.config import ModelConfig, preset
from nanoflash.model import Transformer, c4_layers
from nanoflash.server.engine import (BATCHING, DEFAULT_MAX_RUNNING, MAX_N, RECORDS, SCORING, BadRequest, RolloutEngine,
                                     check_ids, parse_sampling)
from nanoflash.server.http_guard import BoundedHTTPServer, HTTPError, HTTPLimits, make_handler
from nanoflash.server.trace import MAX_TRACE_BYTES, checked_ids, trace
from nanoflash.server.update_guard import GroupPolicy, check_group, disk_files, own_hosts
from nanoflash.sglang.preflight import local_versions
from nanoflash.sglang.transports import (FLAT_FORMAT, LOCAL_FORMAT, SAFE_FORMAT, decode_blob, decode_tensors,
                                           encode_tensors, join_receivers, receive_bucket, take_over)

VERSION = "0.5.16"   # the SGLang release whose request/response shapes this server follows
COMMON = {"/health": "GET", "/health_generate": "GET", "/get_server_info": "GET", "/server_info": "GET",
          "/get_model_info": "GET",
          "/get_weight_version": "GET", "/openapi.json": "GET", "/generate": "POST", "/abort_request": "POST",
          "/pause_generation": "POST", "/continue_generation": "POST", "/flush_cache": "GET,POST",
          "/update_weights_from_tensor": "POST", "/update_weights_from_disk": "POST",
          "/init_weights_update_group": "POST", "/destroy_weights_update_group": "POST",
          "/update_weights_from_distributed": "POST", "/update_weight_version": "POST",
          "/weights_checker": "GET,POST", "/nanoflash/trace": "POST"}
EXTRA = {"stock": {}, "post_process": {"/post_process_weights": "POST"},
         "session": {"/begin_weight_update": "POST", "/end_weight_update": "POST"}}


class RolloutServer:
    """Route handlers over one `RolloutEngine`: `check(method, path)` (404/405 before any body is read), then
    `handle(method, path, body) -> (status, json)`. `disk_root`, `group_policy`: update_guard.py. `model_path`: the
    checkpoint it was loaded from (None: seeded), reported as SGLang reports its own (sglang.preflight)."""

    def __init__(self, engine: RolloutEngine, protocol: str = "stock", api_key: str | None = None, tp_size: int = 1,
                 disk_root: str | None = None, group_policy: GroupPolicy | None = None,
                 max_request_tokens: int | None = None, model_path: str | None = None,
                 max_trace_bytes: int = MAX_TRACE_BYTES):
        if protocol not in EXTRA:
            raise ValueError(f"protocol must be one of {sorted(EXTRA)}, got {protocol!r}")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.engine, self.protocol, self.api_key, self.tp_size = engine, protocol, api_key, tp_size
        self.disk_root, self.group_policy = disk_root, group_policy or GroupPolicy()
        self.model_path, self.versions = model_path, local_versions()   # tests may make either say otherwise
        self.max_request_tokens = max_request_tokens or MAX_N * engine.cfg.max_seq_len
        self.max_trace_bytes = max_trace_bytes
        self.routes = {**COMMON, **EXTRA[protocol]}
        self.session_open = False
        self.groups: dict = {}
        self.snapshot = None

    def check(self, method: str, path: str) -> None:
        if path not in self.routes:
            raise HTTPError(404, f"no route {path} (protocol {self.protocol})")
        if method not in self.routes[path].split(","):
            raise HTTPError(405, f"{path} takes {self.routes[path]}, not {method}")

    def handle(self, method: str, path: str, body):
        self.check(method, path)
        if method == "POST" and not isinstance(body, (dict, list)):
            raise BadRequest(f"{path}: the request body must be a JSON object")
        if path == "/health_generate":
            return self.health_generate()
        fn = getattr(self, "r_" + path.strip("/").replace(".", "_").replace("/", "_"))
        out = fn(body if isinstance(body, dict) else {})
        return 200, out

    # ------------------------------------------------------------------ info
    def r_health(self, _):
        return {}

    def health_generate(self):
        """One greedy token through the served weights: 200, or 503 naming why generation fails."""
        try:
            self.engine.health_check()
        except Exception as e:  # any failure to generate is the answer, not a server error
            msg = f"generation fails: {type(e).__name__}: {e}"
            return 503, {"success": False, "message": msg, "error": {"message": msg}}
        return 200, {}

    def r_server_info(self, body):
        return self.r_get_server_info(body)

    def r_get_server_info(self, _):   # SGLang's own fields (model_path, load_format, quantization: its server_args)
        e = self.engine   # capacity as SGLang 0.5.16 reports it: the flag, and per DP rank what the scheduler runs
        return {"version": VERSION, "engine": "nanoflash", "protocol": self.protocol, "tp_size": self.tp_size,
                "max_running_requests": e.max_running, "internal_states": [
                    {"effective_max_running_requests_per_dp": e.max_running, "num_running_reqs": e.running}],
                "dp_size": 1, "pp_size": 1, "model_path": self.model_path or "nanoflash", "quantization": None,
                "load_format": "auto" if self.model_path else "dummy", "torch_version": self.versions["torch"],
                "nccl_version": self.versions["nccl"], "weights": self.engine.weights,
                # SGLang's flag: this engine reports the records when asked, if the model has a C4 layer
                "enable_return_indexer_topk": bool(c4_layers(e.cfg)),
                "weight_version": self.engine.weight_version}

    def r_get_model_info(self, _):
        return {"model_path": self.model_path or "nanoflash", "is_generation": True,
                "weight_version": self.engine.weight_version}

    def r_get_weight_version(self, _):
        return {"weight_version": self.engine.weight_version}

    def r_openapi_json(self, _):
        return {"openapi": "3.1.0", "info": {"title": "nanoflash rollout server", "version": VERSION},
                "paths": {p: {m.lower(): {} for m in ms.split(",")} for p, ms in self.routes.items()}}

    # ------------------------------------------------------------------ generation
    def r_generate(self, body):
        ids = body.get("input_ids")
        if body.get("text") is not None:
            raise BadRequest("/generate: this server has no tokenizer; send input_ids, not text")
        batch = isinstance(ids, list) and ids and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        V = self.engine.cfg.vocab_size
        for p in prompts:
            check_ids("/generate", p, V)
        sp = parse_sampling(body.get("sampling_params", {}), V)
        asked = len(prompts) * sp["n"] * max(1, sp["max_new_tokens"])
        if asked > self.max_request_tokens:
            raise BadRequest(f"/generate: {len(prompts)} prompt(s) x n={sp['n']} x max_new_tokens="
                             f"{sp['max_new_tokens']} = {asked} tokens exceeds this server's "
                             f"max_request_tokens={self.max_request_tokens}; split the request")
        rid, start = body.get("rid"), body.get("logprob_start_len", -1)
        records = tuple(n for n in RECORDS if body.get(f"return_{n}"))   # return_routed_experts, return_indexer_topk
        if type(start) is not int or start < -1:
            raise BadRequest(f"/generate: logprob_start_len={start!r} is invalid: want an int >= -1")
        out = []
        for i, p in enumerate(prompts):
            res = self.engine.generate(p, sp, rid=f"{rid}-{i}" if rid and batch else rid, records=records)
            if start >= 0 and body.get("return_logprob"):   # SGLang's prefill scoring of the input itself
                lps = self.engine.input_logprobs(p, start, sp["temperature"])
                for r in res:
                    r["meta_info"]["input_token_logprobs"] = lps
            out += res
        return out if batch or sp["n"] > 1 else out[0]

    def r_abort_request(self, body):
        self.engine.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")))
        return {"success": True}

    def r_pause_generation(self, body):
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"pause_generation mode {mode!r} not in abort|retract|in_place")
        self.engine.pause(mode)
        return {"success": True, "message": f"paused ({mode})"}

    def r_continue_generation(self, _):
        self.engine.unpause()
        return {"success": True}

    def r_flush_cache(self, _):
        return {"success": True, "message": "no prefix cache to flush"}

    # ------------------------------------------------------------------ weight updates
    def _update(self, named, body, path):
        if self.protocol == "session" and not self.session_open:
            raise BadRequest(f"{path} outside a weight-update session: call /begin_weight_update first")
        with self.engine.lock:   # a sample carries the new version only once the new weights are live
            written = self.engine.load(named)
            if self.protocol == "stock" or path == "/update_weights_from_disk":
                self.engine.post_process()
            if body.get("weight_version") is not None:
                self.engine.weight_version = str(body["weight_version"])
        return {"success": True, "message": f"loaded {len(written)} tensor(s)"}

    def r_update_weights_from_tensor(self, body):
        fmt = body.get("load_format")
        if fmt == LOCAL_FORMAT:  # a handle to tensors the trainer in this same process parked (no bytes)
            try:
                named = take_over(body.get("handle"))
            except ValueError as e:
                raise BadRequest(str(e)) from None
            return self._update(named, body, "/update_weights_from_tensor")
        if fmt != SAFE_FORMAT:
            raise BadRequest(f"/update_weights_from_tensor: load_format {fmt!r} is a pickled payload, which this "
                             f"server never unpickles; send load_format={SAFE_FORMAT!r} (base64 safetensors)")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) not in (1, self.tp_size) \
                or not all(isinstance(x, str) for x in payloads):
            raise BadRequest(f"serialized_named_tensors must be a list of 1 or tp_size={self.tp_size} strings")
        return self._update(decode_tensors(payloads[0]), body, "/update_weights_from_tensor")

    def r_update_weights_from_disk(self, body):
        named = []
        for f in disk_files(self.disk_root, body.get("model_path")):
            with open(f, "rb") as fh:
                try:
                    named += decode_blob(fh.read())
                except ValueError as e:
                    raise BadRequest(f"/update_weights_from_disk: {f}: {e}") from None
        return self._update(named, body, "/update_weights_from_disk")

    def r_init_weights_update_group(self, body):
        """Join the group with this server's `tp_size` ranks, `rank_offset + tp_rank` as SGLang does; every
        parameter is checked first (`update_guard.check_group`)."""
        g = check_group(body, self.tp_size, self.group_policy, len(self.groups))
        if g["group_name"] in self.groups:  # SGLang 0.5.16: torch refuses a name created twice (-> 400)
            raise BadRequest(f"Failed to initialize custom process group: group {g['group_name']!r} already "
                             "exists; POST /destroy_weights_update_group first")
        pgs = join_receivers(g["master_address"], g["master_port"], g["ranks"], g["world"], g["group_name"],
                             g["backend"], g["timeout_s"], self.engine.device)
        self.groups[g["group_name"]] = (pgs, g["backend"])
        return {"success": True, "message": f"joined {g['group_name']} as ranks {g['ranks'].start}.."
                                            f"{g['ranks'].stop - 1}"}

    def r_destroy_weights_update_group(self, body):
        if self.groups.pop(body.get("group_name"), None) is None:  # dropped: its members are unregistered
            raise BadRequest("The group to be destroyed does not exist.")  # SGLang 0.5.16 answers 400 too
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def r_update_weights_from_distributed(self, body):
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group = self.groups.get(body.get("group_name"))
        if group is None:
            raise BadRequest(f"unknown group_name {body.get('group_name')!r}; call /init_weights_update_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must be lists of equal length")
        specs = []
        for n, d, s in zip(names, dtypes, shapes):
            dt = getattr(torch, str(d), None)
            if not isinstance(dt, torch.dtype) or not isinstance(s, list):
                raise BadRequest(f"tensor {n}: bad dtype {d!r} or shape {s!r}")
            specs.append((n, dt, s))
        fmt = body.get("load_format")
        if fmt not in (None, FLAT_FORMAT):
            raise BadRequest(f"load_format {fmt!r}: this server takes none or {FLAT_FORMAT!r}")
        if self.protocol == "session" and not self.session_open:
            raise BadRequest("/update_weights_from_distributed outside a weight-update session")
        named = receive_bucket(group[0], group[1], specs, fmt == FLAT_FORMAT, self.engine.device)
        return self._update(named, body, "/update_weights_from_distributed")

    def r_update_weight_version(self, body):
        if "new_version" not in body:
            raise BadRequest("/update_weight_version needs new_version")
        self.engine.weight_version = str(body["new_version"])
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        return {"success": True}

    def r_begin_weight_update(self, _):
        if self.session_open:
            raise BadRequest("a weight-update session is already open")
        self.session_open = True
        return {"success": True}

    def r_end_weight_update(self, _):
        if not self.session_open:
            raise BadRequest("/end_weight_update without /begin_weight_update")
        self.engine.post_process()
        self.session_open = False
        return {"success": True}

    def r_post_process_weights(self, body):
        if body.get("post_process_quantization"):
            self.engine.post_process()
        return {"success": True}

    def r_weights_checker(self, body):
        with self.engine.lock:  # never hash a store that an update is writing
            return self._weights_checker(body)

    def _weights_checker(self, body):
        action = body.get("action", "checksum")  # SGLang's CheckWeightsReqInput default
        if action == "checksum":
            sums = self.engine.store.checksums()
            extra = {"derived_checksum": self.engine.derived_checksum()} if body.get("derived") else {}
            ranks = [{"checksums": sums, **extra,   # TP ranks hold the same (unsharded) copy
                      "parallelism_info": {"tp_rank": k, "tp_size": self.tp_size, "dp_rank": 0, "dp_size": 1,
                                           "pp_rank": 0, "pp_size": 1, "rank": k, "size": self.tp_size}}
                     for k in range(self.tp_size)]
            return {"success": True, "message": f"{len(sums)} tensors", "ranks": ranks}
        if action == "snapshot":
            self.snapshot = self.engine.store.checksums()
            return {"success": True, "message": "snapshot taken"}
        if action == "compare":
            if self.snapshot is None:
                raise BadRequest("weights_checker compare before snapshot")
            now = self.engine.store.checksums()
            bad = sorted(n for n in now if self.snapshot.get(n) != now[n])
            if bad:
                raise BadRequest(f"check tensor equality failed: {bad[:8]}")
            return {"success": True, "message": "equal"}
        raise BadRequest(f"weights_checker action {action!r} not in checksum|snapshot|compare")


    def r_nanoflash_trace(self, body):
        """nanoflash extension: activations at every block boundary for `input_ids` (mismatch localization);
        bounded (`trace.checked_ids`), loopback-only without a key (`http_guard.LOCAL_ROUTES`)."""
        ids = checked_ids(body, self.engine.model, self.max_trace_bytes)
        with self.engine.lock:
            acts = trace(self.engine.model, torch.tensor([ids]))
        return {"trace": encode_tensors(list(acts.items()))}


def make_httpd(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, protocol: str = "stock",
               api_key: str | None = None, tp_size: int = 1, disk_root: str | None = None, group_hosts=None,
               limits: HTTPLimits | None = None, max_request_tokens: int | None = None, model_path: str | None = None,
               max_trace_bytes: int = MAX_TRACE_BYTES):
    """The bound (not yet serving) HTTP server; `httpd.rollout` is its RolloutServer. group_hosts: allowed
    master addresses besides loopback and `host` (("*",) = any)."""
    hosts = ("*",) if group_hosts and "*" in group_hosts else own_hosts(host, group_hosts or ())
    rs = RolloutServer(engine, protocol, api_key, tp_size, disk_root, GroupPolicy(hosts=hosts), max_request_tokens,
                       model_path, max_trace_bytes)
    limits = limits or HTTPLimits()
    httpd = BoundedHTTPServer((host, port), make_handler(rs, limits), limits.max_connections)
    httpd.rollout = rs
    return httpd


def serve(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, protocol: str = "stock",
          api_key: str | None = None, tp_size: int = 1, **kw):
    """Start serving in a background thread; returns (httpd, url). `port=0` picks a free port. `tp_size`: how
    many ranks it joins into a weight-update group (each receives every bucket, as SGLang's TP ranks do);
    `kw`: make_httpd's disk_root, group_hosts, limits, max_request_tokens, model_path."""
    httpd = make_httpd(engine, host, port, protocol, api_key, tp_size, **kw)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://{host}:{httpd.server_address[1]}"


def build_engine(args) -> RolloutEngine:
    """The model of `--checkpoint` (official/HF safetensors via checkpoint.load_hf_checkpoint) or of
    `--preset` with `init_weights(--seed)`, on `--device`, wrapped in an engine."""
    torch.manual_seed(args.seed)
    if args.checkpoint:
        cfg = ModelConfig.from_hf_config(args.checkpoint)
        with torch.device("meta"):
            model = Transformer(cfg)
        load_hf_checkpoint(model, args.checkpoint, cfg, device=args.device)
    else:
        with torch.device(args.device):
            model = Transformer(preset(args.preset)).init_weights(args.seed)
    if args.weights == "bf16":
        model.cast_(torch.bfloat16)
    return RolloutEngine(model, weights=args.weights, decode=args.decode, seed=args.seed,
                         max_running=args.max_running_requests, batching=args.batching, score=args.score)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="model preset (ignored with --checkpoint)")
    ap.add_argument("--checkpoint", default=None, help="directory with config.json + *.safetensors")
    ap.add_argument("--seed", type=int, default=0, help="weight init and sampling seed")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health*)")
    ap.add_argument("--disk-root", default=None, help="/update_weights_from_disk reads only below this directory")
    ap.add_argument("--group-hosts", default="", help="extra master addresses to join weight groups at (* = any)")
    ap.add_argument("--read-timeout", type=float, default=HTTPLimits.read_timeout_s, help="request read deadline, s")
    ap.add_argument("--max-connections", type=int, default=HTTPLimits.max_connections, help="open connections")
    ap.add_argument("--max-request-tokens", type=int, default=0, help="prompts x n x max_new_tokens per "
                    "/generate (0: MAX_N x max_seq_len)")
    ap.add_argument("--max-running-requests", type=int, default=DEFAULT_MAX_RUNNING, help="sequences decoding at "
                    "once (SGLang's flag); more wait in a queue. Reported in /server_info")
    ap.add_argument("--max-trace-bytes", type=int, default=MAX_TRACE_BYTES, help="largest /nanoflash/trace answer")
    ap.add_argument("--weights", default=None, choices=["fp32", "bf16", "fp8"], help="default fp32 (fp8 with "
                    "--model-path)")
    ap.add_argument("--protocol", default="stock", choices=sorted(EXTRA))
    ap.add_argument("--decode", default="auto", choices=["auto", "cache", "full"])
    ap.add_argument("--batching", default="continuous", choices=list(BATCHING), help="every running request in "
                    "each step's forward, or one request at a time (engine.py)")
    ap.add_argument("--score", default="auto", choices=list(SCORING), help="log-probs: each sample alone "
                    "(exact), in one padded forward per step (batched), auto: exact on CPU / fp32 (engine.py)")
    ap.add_argument("--tp-size", type=int, default=1, help="ranks joined into a weight-update group (as SGLang TP)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:1 ...")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    sg = ap.add_argument_group("SGLang's launch flags (sglang.launch_server), for its command lines unchanged")
    sg.add_argument("--model-path", default=None, help="= --checkpoint, served in FP8 (as SGLang serves it)")
    sg.add_argument("--tp", type=int, dest="tp_size", help="= --tp-size")
    sg.add_argument("--skip-tokenizer-init", action="store_true", help="token ids in and out: what this server does")
    sg.add_argument("--enable-return-routed-experts", action="store_true", help="R3 records on request: always")
    sg.add_argument("--mem-fraction-static", type=float, default=None, help="SGLang's static KV pool share; this "
                    "engine keeps no static pool (its decode cache is per request)")
    args = ap.parse_args(argv)
    if args.model_path:
        if args.checkpoint and args.checkpoint != args.model_path:
            ap.error(f"--model-path {args.model_path} and --checkpoint {args.checkpoint} name two checkpoints")
        args.checkpoint, args.weights = args.model_path, args.weights or "fp8"
    args.weights = args.weights or "fp32"
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(args)
    limits = HTTPLimits(read_timeout_s=args.read_timeout, max_connections=args.max_connections)
    httpd = make_httpd(engine, args.host, args.port, args.protocol, args.api_key, args.tp_size, args.disk_root,
                       [h for h in args.group_hosts.split(",") if h], limits, args.max_request_tokens or None,
                       args.checkpoint, args.max_trace_bytes)
    print(f"nanoflash rollout server on http://{args.host}:{httpd.server_address[1]} "
          f"(protocol {args.protocol}, weights {args.weights}, cache decode {engine.use_cache})", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()

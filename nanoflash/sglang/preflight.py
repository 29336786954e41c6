"""What the trainer checks about every server before its first push; a mismatch is one line naming both sides.

    check_servers(client, weights, distributed)   # -> notes; raises ServerMismatch

**Indexer replay** (`rollout.indexer_replay`): every server must report its C4 kept sets (`check_indexer_topk`:
the flag, then one greedy request long enough for the top-k to select, whose record must be one the trainer
can replay -- the seam tested against the live server at every start, not only against nanoflash's own).

**Expert storage.** The stream sends routed experts as FP8 128x128 blocks when `rollout.weights=fp8`, else in the
trainer's dtype; a server must hold them the same way (SGLang's loader checks neither dtype nor width of what it
is sent, `shared/docs/sglang_loader_check.md`). SGLang 0.5.16 reports no field for it. It decides once, at start-up
(`ModelConfig.__init__`, srt/configs/model_config.py L339-359): for a DeepSeek-V4 model `is_fp4_experts` is the
variable SGLANG_DSV4_FP4_EXPERTS when set (srt/environ.py L995: default True; `EnvBool.parse` L125-132), else
the dtype of the first routed-expert weight in the checkpoint's safetensors header (`try_detect_fp4_experts`,
srt/configs/deepseek_v4.py L13-44, through `probe_routed_expert_weight_dtype`, srt/model_loader/weight_utils.py
L82-129: U8/I8/F4 -> FP4, F8_E4M3 -> FP8), else the default (FP4). Of those inputs its HTTP API reports
`model_path`, `load_format` and `quantization` (`/server_info` = `/get_server_info`: `dataclasses.asdict(
server_args)`, the scheduler's info and `version`, srt/entrypoints/http_server.py L733-765; `/model_info` adds
model_type and architectures, L703-720) and never the environment. So the trainer decides as SGLang does, from
the checkpoint at the reported `model_path` (the reference deployment keeps it at the same path on every node)
and from SGLANG_DSV4_FP4_EXPERTS *as the trainer sees it*: both sides export the same value (docs/demo.md).
Refused: an FP8 stream against FP4 experts, and a checkpoint whose experts contradict a set variable (FP4 on
disk, SGLANG_DSV4_FP4_EXPERTS=0: convert it with `python -m nanoflash.export --from-release`). Unchecked: a
server started with another value of the variable than the trainer's; the first push's verification
(`transports.verify_real_server`: the FP8 experts' own hashes) catches that. nanoflash's embedded server reports
the same fields (its `--checkpoint` as model_path, load_format "dummy" for a seeded preset); with no checkpoint
it holds experts as its `--weights` says (it reads no variable).

**torch and NCCL.** A distributed push is one process group across both sides: torch's store protocol and
NCCL's wire format are not promised across versions. SGLang 0.5.16's /server_info reports SGLang's version and
neither torch's nor NCCL's (checked in the routes of http_server.py: none reports them). What can be checked is
the torch its wheel pins (`Requires-Dist: torch==2.11.0`, the 0.5.16 wheel's METADATA; 0.5.23 pins 2.14.1),
against the trainer's torch. NCCL cannot be derived from that: PyPI's torch 2.11.0 requires
nvidia-nccl-cu13==2.28.9, an image's own build of torch 2.11 (NGC) links its own NCCL, so equal torch versions
do not prove equal NCCL. Install the trainer into the SGLang image's Python (docs/demo.md): one torch, one NCCL.
A server that reports `torch_version` / `nccl_version` (the embedded server does) is compared on both.

Tests: `pytest tests/test_server_preflight.py -q`.
"""
from __future__ import annotations

import json
import os
import re
import struct

import torch
import torch.distributed as dist

from nanoflash.model import c4_layers, check_replay_record
from nanoflash.sglang.client import decode_indexer_topk, parse_version

FP4_ENV = "SGLANG_DSV4_FP4_EXPERTS"
# SGLang release -> the torch its wheel pins (Requires-Dist: torch==...), for servers that report no torch
SGLANG_TORCH = {(0, 5, 16): "2.11.0", (0, 5, 23): "2.14.1"}
# SGLang's `_ROUTED_EXPERT_KEY_RE` (srt/model_loader/weight_utils.py L82-84)
ROUTED_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(?:w[123]|down_proj|up_proj|gate_proj)\.weight$")


class ServerMismatch(ValueError):
    """A server that does not match the trainer (expert storage, torch, NCCL); the message is one line."""


def routed_expert_dtype(model_path) -> str | None:
    """The safetensors dtype of the first routed-expert weight under `model_path`, as SGLang probes it; None when
    the path is no readable checkpoint (not a directory here, no index, no expert key)."""
    index = os.path.join(str(model_path), "model.safetensors.index.json")
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {}) or {}
        key = next((k for k in weight_map if ROUTED_EXPERT_KEY.search(k)), None)
        if key is None:
            return None
        with open(os.path.join(str(model_path), weight_map[key]), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(n)).get(key)
    except (OSError, ValueError, struct.error):
        return None
    return meta.get("dtype") if isinstance(meta, dict) else None


def env_fp4(env) -> bool | None:
    """SGLANG_DSV4_FP4_EXPERTS as SGLang's EnvBool reads it: None when unset; an invalid value is its default."""
    if FP4_ENV not in env:
        return None
    v = env[FP4_ENV].lower()
    return v not in ("false", "0", "no", "n") if v in ("true", "1", "yes", "y", "false", "0", "no", "n") else True


def _quantized(info: dict) -> bool:
    """Does the server run a quantized checkpoint? `quantization` set, or a quantization_config in the config.json
    at model_path; a config the trainer cannot read counts as quantized (every V4 release is)."""
    if info.get("quantization"):
        return True
    try:
        with open(os.path.join(str(info.get("model_path")), "config.json")) as f:
            return "quantization_config" in json.load(f)
    except (OSError, ValueError):
        return True


def served_experts(info: dict, env=os.environ) -> tuple[str, str]:
    """(fp4 | fp8 | unquantized, why) for a server's /server_info, decided as SGLang 0.5.16 decides (module
    docstring). Raises ServerMismatch for a checkpoint that contradicts the variable."""
    path, fmt = info.get("model_path"), info.get("load_format") or "auto"
    dtype, var = routed_expert_dtype(path), env_fp4(env)
    on_disk = {"U8": "fp4", "I8": "fp4", "F4": "fp4", "F8_E4M3": "fp8"}.get(dtype)
    if dtype and not on_disk:   # BF16 experts on disk: an unquantized checkpoint
        return "unquantized", f"routed experts stored {dtype} in {path}"
    if info.get("engine") == "nanoflash" and not dtype:   # a seeded embedded server (it reads no variable):
        return ("fp8" if info.get("weights") == "fp8" else "unquantized"), \
            f"embedded server --weights {info.get('weights')}"    # it holds what its --weights say
    if var is not None:
        said = "fp4" if var else "fp8"
        if on_disk and on_disk != said and fmt != "dummy":
            raise ServerMismatch(f"{info.get('url', 'a server')} loads {path}, whose routed experts are {dtype} "
                                 f"({on_disk.upper()}), but {FP4_ENV}={env[FP4_ENV]} makes SGLang build "
                                 f"{said.upper()} expert parameters; "
                                 + ("convert it: python -m nanoflash.export --from-release DIR OUT --experts fp8"
                                    if on_disk == "fp4" else f"unset {FP4_ENV} on both sides"))
        return (said if _quantized(info) else "unquantized"), f"{FP4_ENV}={env[FP4_ENV]}"
    if on_disk:
        return on_disk, f"routed experts stored {dtype} in {path}"
    return "fp4", (f"SGLang's default: {FP4_ENV} unset here and no checkpoint readable at {path!r}; "
                   f"export {FP4_ENV}=0 on both sides for FP8 experts")


def check_experts(client, weights: str, env=os.environ) -> None:
    """Every server must hold routed experts as the stream sends them (`rollout.weights`)."""
    sent = "fp8" if weights == "fp8" else "unquantized"
    for url in client.urls:
        held, why = served_experts({**client.server_info(url), "url": url}, env)
        if held != sent:
            raise ServerMismatch(f"{url} holds routed experts {held.upper()} ({why}), but rollout.weights="
                                 f"{weights} sends them {sent.upper()}")


def local_versions() -> dict:
    """This process's torch and (on a CUDA build with NCCL) NCCL version, as strings."""
    v = torch.cuda.nccl.version() if dist.is_nccl_available() else None
    return {"torch": torch.__version__, "nccl": ".".join(map(str, v)) if isinstance(v, tuple) else v and str(v)}


def server_versions(info: dict) -> tuple[dict, str]:
    """({torch, nccl}, where from): reported by the server, or the torch its SGLang release pins; None: unknown."""
    if info.get("torch_version"):
        return {"torch": info["torch_version"], "nccl": info.get("nccl_version")}, "reported by the server"
    ver = parse_version(info.get("version", ""))
    pin = SGLANG_TORCH.get(ver)
    if pin is None:
        return {"torch": None, "nccl": None}, f"SGLang {info.get('version')!r}, whose torch nanoflash does not know"
    return {"torch": pin, "nccl": None}, f"pinned by SGLang {'.'.join(map(str, ver))} (torch=={pin})"


def check_versions(client, mine: dict | None = None) -> list[str]:
    """A distributed push's two sides must run the same torch, and NCCL where both are known. -> notes on what
    could not be checked; raises ServerMismatch naming both versions."""
    mine, notes = mine or local_versions(), []
    for url in client.urls:
        theirs, how = server_versions(client.server_info(url))
        for what in ("torch", "nccl"):
            a, b = mine[what], theirs[what]
            if a is None or b is None:
                if what == "torch" or a is not None:
                    notes.append(f"{url}: {what} not checked ({how})")
            elif (parse_version(a) != parse_version(b)) if what == "torch" else a != b:
                raise ServerMismatch(f"{url} runs {what} {b} ({how}), the trainer {what} {a}: a distributed push "
                                     f"needs one {what} on both sides (install the trainer into the server's "
                                     f"Python environment, docs/demo.md)")
    return notes


def check_indexer_topk(client, mcfg=None) -> None:
    """Indexer replay needs every server to report its C4 kept sets: SGLang 0.5.16 does when started with
    `--enable-return-indexer-topk` (srt/server_args.py L2851; /server_info holds the server args, so the flag
    `enable_return_indexer_topk`), and without it answers requests that ask for them with no record at all.
    With the model's config `mcfg`, each server is then asked once (`probe_indexer_record`)."""
    for url in client.urls:
        on = client.server_info(url).get("enable_return_indexer_topk")
        if on is not True:
            raise ServerMismatch(f"{url} reports enable_return_indexer_topk={on!r}: rollout.indexer_replay needs "
                                 f"each server's C4 kept sets (start SGLang with --enable-return-indexer-topk; "
                                 f"nanoflash's embedded server always reports them)")
        if mcfg is not None:
            probe_indexer_record(client, url, mcfg)


def probe_indexer_record(client, url: str, mcfg) -> None:
    """One greedy token after a prompt of 4 x index_topk + 8 tokens (fewer if max_seq_len is shorter), asking
    for the record: it must be what the collector accepts and the trainer replays -- one row per input position
    (prompt + 1 - 1), C4 layers x index_topk a row (`client.decode_indexer_topk`), no entry a query cannot see
    and at most index_topk (`model.check_replay_record`), and the last query keeping min(index_topk, its visible
    entries). Else one ServerMismatch naming the server and what differs."""
    K, n_c4 = mcfg.index_topk, len(c4_layers(mcfg))
    P = max(8, min(4 * K + 8, mcfg.max_seq_len - 1))
    prompt = [(7 * i + 3) % min(mcfg.vocab_size, 1000) for i in range(P)]
    try:
        gen = client.generate(prompt, {"max_new_tokens": 1, "temperature": 0.0}, url=url,
                              return_indexer_topk=True)[0]
        kept = indexer_record(gen.meta_info, P + len(gen.output_ids) - 1, mcfg)
        counts = (kept[P - 1] >= 0).sum(-1).tolist()   # the last prompt query (position P - 1) sees P // 4 entries
        if min(counts) != min(K, P // 4):
            raise ValueError(f"the query at {P - 1} keeps {counts} entries per C4 layer, want {min(K, P // 4)}")
    except (ValueError, RuntimeError) as e:
        raise ServerMismatch(f"{url}: its indexer record cannot be replayed ({e}); rollout.indexer_replay needs "
                             f"[tokens - 1, {n_c4} C4 layers, index_topk {K}] of the entries each query kept") from None


def indexer_record(meta_info: dict, rows: int, mcfg):
    """The indexer record of one answer whose sequence has `rows` input positions (prompt + output - 1), checked
    as indexer replay needs it (the collector's check of every record, and the start-up probe's): present
    (RuntimeError), `rows` rows of C4 layers x index_topk entries (`client.decode_indexer_topk`), no entry a
    query cannot see and at most index_topk (`model.check_replay_record`; ValueError naming what differs).
    -> int64 [rows, C4 layers, index_topk]"""
    if "indexer_topk" not in meta_info:
        raise RuntimeError("rollout.indexer_replay: a rollout server (rollout.urls) sent no indexer_topk record: "
                           "SGLang needs --enable-return-indexer-topk (nanoflash's embedded server always sends one)")
    kept = decode_indexer_topk(meta_info, len(c4_layers(mcfg)), mcfg.index_topk)
    if kept.shape[0] != rows:
        raise ValueError(f"indexer record of {kept.shape[0]} rows, want {rows} (prompt + output - 1)")
    check_replay_record(kept, mcfg.index_topk)
    return kept


def check_servers(client, weights: str, distributed: bool, env=os.environ, indexer_replay: bool = False,
                  mcfg=None) -> list[str]:
    """The start-up checks of every server (`Collector`): expert storage; torch/NCCL for a distributed push;
    the indexer's kept sets for indexer replay (probed with the model's config `mcfg` when given)."""
    check_experts(client, weights, env)
    if indexer_replay:
        check_indexer_topk(client, mcfg)
    return check_versions(client) if distributed else []

"""What a weight-update request may make the embedded server open: which files, which process groups.

Two routes reach outside the server's own memory, so their arguments are checked before anything is opened:

    /update_weights_from_disk {model_path}
        model_path must name a directory at or below the server's `disk_root` (after resolving `..` and symbolic
        links: os.path.realpath); no root configured = the route is refused. The name is taken literally (no
        wildcard expansion: `*`, `?`, `[` are refused), and only the regular `*.safetensors` files directly in
        it are read, each of which must itself resolve below the root.
    /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend,
                                timeout_s}
        the server only *joins* groups (its ranks are rank_offset .. rank_offset + tp_size - 1 >= 1; rank 0,
        which hosts the TCP store, is the trainer), so it never listens; it connects to master_address, which
        must be one of `GroupPolicy.hosts` (default: loopback and the address the server is bound to;
        "*" = any host), never a wildcard address; ports 1..65535; world_size <= max_world;
        0 < timeout_s <= max_timeout_s (the longest a join may hold a request thread); the group name is
        1-64 characters of [A-Za-z0-9_.-]; at most `max_groups` groups at once. Every value must be of the
        JSON type it names (an int, not a float or a string of one). With an API key set the route needs it.

Anything else is one BadRequest (HTTP 400) naming the field and what it must be.

Differs from SGLang: SGLang's `/update_weights_from_disk` loads any path its process can read (it is a
model path) and `/init_weights_update_group` connects wherever it is told; both sit behind its API key.

Tests: `pytest tests/test_rollout_http_limits.py -q`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from nanoflash.server.engine import BadRequest

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("", "0.0.0.0", "::", "*")          # "every interface": never a master address
GROUP_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_JOIN_TIMEOUT_S = 120.0                  # what the trainer's Broadcaster waits for its side


@dataclass
class GroupPolicy:
    """Which process groups `/init_weights_update_group` may join (see the module docstring)."""

    hosts: tuple = LOOPBACK                     # allowed master addresses; ("*",) = any host
    max_world: int = 4096                       # ranks in one group (the trainer + every server's TP ranks)
    max_timeout_s: float = 600.0                # the longest one join may block a request thread
    max_groups: int = 8                         # groups joined at once


def own_hosts(bind_host: str, extra=()) -> tuple:
    """Default allowed masters: loopback, the address the server is bound to (unless a wildcard), `extra`."""
    own = () if bind_host in WILDCARDS else (bind_host,)
    return tuple(dict.fromkeys(LOOPBACK + own + tuple(extra)))


def _int(body: dict, key: str, lo: int, hi: int, default=None) -> int:
    v = body.get(key, default)
    if type(v) is not int or not lo <= v <= hi:
        raise BadRequest(f"/init_weights_update_group: {key}={v!r} must be an int in [{lo}, {hi}]")
    return v


def check_group(body: dict, tp_size: int, policy: GroupPolicy, n_groups: int) -> dict:
    """Validated join parameters: {master_address, master_port, ranks, world, group_name, backend, timeout_s}."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size", "group_name") if k not in body]
    if missing:
        raise BadRequest(f"/init_weights_update_group lacks {missing}")
    addr, name, backend = body["master_address"], body["group_name"], body.get("backend", "gloo")
    if not isinstance(addr, str) or addr.strip().lower() in WILDCARDS:
        raise BadRequest(f"/init_weights_update_group: master_address={addr!r} must name one host, not a wildcard")
    if "*" not in policy.hosts and addr.strip().lower() not in {h.lower() for h in policy.hosts}:
        raise BadRequest(f"/init_weights_update_group: master_address={addr!r} is not one this server joins "
                         f"groups at ({', '.join(policy.hosts)}; start it with --group-hosts to allow others)")
    if backend not in ("gloo", "nccl"):
        raise BadRequest(f"backend {backend!r}: the embedded server joins gloo or nccl groups")
    if not isinstance(name, str) or not GROUP_NAME_RE.match(name):
        raise BadRequest(f"/init_weights_update_group: group_name={str(name)[:80]!r} must be 1-64 characters "
                         "of [A-Za-z0-9_.-]")
    port = _int(body, "master_port", 1, 65535)
    world = _int(body, "world_size", 1 + tp_size, policy.max_world)
    off = _int(body, "rank_offset", 1, world - tp_size)
    t = body.get("timeout_s", DEFAULT_JOIN_TIMEOUT_S)
    if type(t) not in (int, float) or not 0 < t <= policy.max_timeout_s:
        raise BadRequest(f"/init_weights_update_group: timeout_s={t!r} must be a number in (0, "
                         f"{policy.max_timeout_s:g}]")
    if n_groups >= policy.max_groups:
        raise BadRequest(f"/init_weights_update_group: already in {n_groups} groups (max {policy.max_groups}); "
                         "destroy one first")
    return {"master_address": addr.strip(), "master_port": port, "ranks": range(off, off + tp_size),
            "world": world, "group_name": name, "backend": backend, "timeout_s": float(t)}


def disk_files(root: str | None, model_path) -> list:
    """The `*.safetensors` files of `model_path`, which must be a directory at or below `root`."""
    where = "/update_weights_from_disk"
    if not root:
        raise BadRequest(f"{where}: this server has no disk root (start it with --disk-root DIR); it reads no "
                         "path a client names")
    if not isinstance(model_path, str) or not model_path:
        raise BadRequest(f"{where}: model_path={model_path!r} must be a directory name")
    if any(c in model_path for c in "*?["):
        raise BadRequest(f"{where}: model_path={model_path!r} contains a wildcard; name one directory")
    top, path = os.path.realpath(root), os.path.realpath(model_path)
    if os.path.commonpath([top, path]) != top:
        raise BadRequest(f"{where}: model_path={model_path!r} is outside the server's disk root {root!r}")
    if not os.path.isdir(path):
        raise BadRequest(f"{where}: model_path={model_path!r} is not a directory")
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    files = [f for f in files if os.path.isfile(f)]
    outside = [f for f in files if os.path.commonpath([top, os.path.realpath(f)]) != top]
    if outside:
        raise BadRequest(f"{where}: {outside[:2]} link outside the server's disk root {root!r}")
    if not files:
        raise BadRequest(f"{where}: no *.safetensors under model_path={model_path!r}")
    return files

"""Save and resume the full training state with `torch.distributed.checkpoint` (DCP), atomically.

What is saved, under `root/step_{N:08d}/`:
    DCP shards      {"model": model.state_dict(), "optim": optimizer.state_dict()}, keyed by full-model FQN
                    (`layers.7.ffn.experts.42.w1.weight`, `layers.7.ffn.experts.42.w1.weight.exp_avg`, ...)
    rng_rank{r}.pt  this rank's torch / CUDA / python RNG states
    meta.json       step, layout (pp, ep, dp) and the trainer's `extra` dict (data position, ...); written last

Resharding comes for free from the names: every rank saves the tensors it holds (replicated ones are
de-duplicated by DCP's planner) and loads exactly the keys of *its* state dict, so a checkpoint written with
PP2 x EP2 loads into PP1, EP4, or a single process. RNG states are restored only when the world size matches.

Atomicity: everything is written into `step_N.tmp/` (DCP fsyncs its files), then rank 0 fsyncs meta.json
and the directory, and renames `step_N.tmp -> step_N` (atomic on POSIX) after a barrier. A crash before the
rename leaves a `.tmp` directory that `latest_checkpoint` ignores and the next save deletes; the last good
checkpoint is never touched. Old checkpoints beyond `keep` are deleted only after the new one is committed.

How this differs from production: no async save (DCP `async_save`) and no staging to pinned memory.
Tests: `pytest tests/test_parallel_checkpoint.py -q`.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from nanoflash.parallel.dims import ParallelDims

STEP_PREFIX, TMP_SUFFIX, META = "step_", ".tmp", "meta.json"


def _barrier(dims: ParallelDims) -> None:
    if dims.world_size > 1:
        dist.barrier()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest committed checkpoint under root (None if there is none)."""
    if not os.path.isdir(root):
        return None
    done = [d for d in os.listdir(root) if d.startswith(STEP_PREFIX) and not d.endswith(TMP_SUFFIX)
            and os.path.exists(os.path.join(root, d, META))]
    return os.path.join(root, max(done)) if done else None


def _commit(tmp: str, final: str, root: str) -> None:
    """Rank 0: make the finished tmp directory the checkpoint (one atomic rename)."""
    _fsync_path(tmp)
    os.rename(tmp, final)
    _fsync_path(root)


def save_checkpoint(root: str, step: int, model, optimizer, dims: ParallelDims, extra: dict | None = None,
                    keep: int = 2) -> str:
    """Write the training state of every rank as checkpoint `step`; returns its path (same on all ranks)."""
    final = os.path.join(root, f"{STEP_PREFIX}{step:08d}")
    tmp = final + TMP_SUFFIX
    if dims.rank == 0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):  # debris of a crashed save (ours or an older one)
            if d.endswith(TMP_SUFFIX):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        os.makedirs(tmp)
    _barrier(dims)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=tmp,
             no_dist=dims.world_size == 1)
    rng_path = os.path.join(tmp, f"rng_rank{dims.rank}.pt")
    torch.save(_rng_state(), rng_path)
    _fsync_path(rng_path)
    _barrier(dims)
    if dims.rank == 0:
        meta = {"step": step, "pp": dims.pp, "ep": dims.ep, "dp": dims.dp, "world_size": dims.world_size,
                "extra": extra or {}}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, final, root)
        _prune(root, keep)
    _barrier(dims)
    return final


def _prune(root: str, keep: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith(STEP_PREFIX) and not d.endswith(TMP_SUFFIX))
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def load_checkpoint(path: str, model, optimizer, dims: ParallelDims) -> dict:
    """Load a checkpoint written by `save_checkpoint` under any PP/EP/DP layout; returns its meta dict."""
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path} is not a committed checkpoint (no {META}); an interrupted save?")
    with open(meta_path) as f:
        meta = json.load(f)
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    try:
        dcp.load(state, checkpoint_id=path, no_dist=dims.world_size == 1)
    except (Exception, CheckpointException) as e:  # DCP names the bad key; add the checkpoint (a BaseException)
        raise ValueError(f"cannot load {path} into this model/optimizer: {e}") from e
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    rng_path = os.path.join(path, f"rng_rank{dims.rank}.pt")
    if meta["world_size"] == dims.world_size and os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return meta


def export_hf(path: str, cfg, out_dir: str, dtype=torch.bfloat16, **save_kw) -> dict:
    """Offline export: a DCP checkpoint of any layout -> one full model in host memory (built on meta, then
    materialised in `dtype`) -> the official HF layout via `nanoflash.checkpoint.save_hf_checkpoint`.
    For flash in bf16 this needs ~545 GB of host memory (see the planner)."""
    from nanoflash.checkpoint import save_hf_checkpoint
    from nanoflash.model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    model.cast_(dtype).to_empty(device="cpu")
    load_checkpoint(path, model, None, ParallelDims())
    return save_hf_checkpoint(model, out_dir, **save_kw)

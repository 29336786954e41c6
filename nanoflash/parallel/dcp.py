"""Save and resume the full training state with `torch.distributed.checkpoint` (DCP), atomically.

What is saved, under `root/step_{N:08d}/`:
    DCP shards      {"model": model.state_dict(), "optim": optimizer.state_dict()}, keyed by full-model FQN
                    (`layers.7.ffn.experts.42.w1.weight`, `layers.7.ffn.experts.42.w1.weight.exp_avg`, ...)
    rng_rank{r}.pt  this rank's torch / CUDA / python RNG states (read back with weights_only=True: plain
                    tensors and ints, so a crafted file cannot run code)
    rank0_*.pt      the caller's own state, from rank 0 (`files=`: e.g. the rollout batch a one-step-off run
                    has generated and not yet trained), also read back with weights_only=True (`load_file`)
    meta.json       step, layout (pp, ep, dp), the trainer's `extra` dict (data position, ...) and a crc32 of
                    every other file ("files"); written last

Resharding comes for free from the names: every rank saves the tensors it holds (replicated ones are
de-duplicated by DCP's planner) and loads exactly the keys of *its* state dict, so a checkpoint written with
PP2 x EP2 loads into PP1, EP4, or a single process. RNG states are restored only when the world size matches.

Integrity: each rank checksums the files it wrote by reading them back after fsync (zlib crc32, ~1 GB/s per
rank; sha256 would take minutes at hundreds of GiB), so a committed checkpoint has been verified once.
`load_checkpoint` re-verifies every file (spread over the ranks, failures all-reduced) before DCP reads it and
raises `CheckpointCorrupt` naming the file; `load_latest` then falls back to the previous checkpoint. Pruning
runs only after the new checkpoint is committed and verified, so the last verified one is never deleted.

Atomicity: everything is written into `step_N.tmp/` (DCP fsyncs its files), then rank 0 fsyncs meta.json
and the directory, and renames `step_N.tmp -> step_N` (atomic on POSIX) after a barrier. A crash before the
rename leaves a `.tmp` directory that `latest_checkpoint` ignores and the next start (`tidy`) or save deletes; the last good
checkpoint is never touched. Old checkpoints beyond `keep` are deleted only after the new one is committed.

Asynchronous saves (`async_save=True`, `--train.async_save`; on in the flash recipe): the state dicts (views
of the live weights and optimizer state) and the RNG states are taken at the save, and everything after --
DCP's write, the checksums, the commit and the pruning -- runs in a thread (`PendingSave`) on a process group
of its own (`group`: the main thread keeps using the side group meanwhile, and two threads must never
interleave collectives on one group). The caller lets the next step's rollout run meanwhile and calls
`PendingSave.wait` before anything changes the weights or the optimizer state (`rl.trainer.Trainer`: before
the next step). No staging copy: DCP's `async_save` first copies the whole state into host memory, which at
flash scale is the offloaded optimizer state again (~220 GiB per rank, 1.7 TiB per node of 2 TiB); here the
live tensors are written in place, which is why nothing may update them before `wait`. A crash during an
async save is the same as during a synchronous one: `step_N.tmp` is never committed and the previous
checkpoint is the one resumed.

How this differs from production: no staging to pinned memory, no overlap with the optimizer step itself.
Tests: `pytest tests/test_parallel_dcp.py tests/test_checkpoint_async.py -q`.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from nanoflash.checkpoint import save_hf_checkpoint
from nanoflash.model import Transformer
from nanoflash.parallel.dims import ParallelDims

STEP_PREFIX, TMP_SUFFIX, META, CORRUPT_SUFFIX = "step_", ".tmp", "meta.json", ".corrupt-"
RANK0_PREFIX = "rank0_"   # files= of save_checkpoint: written by rank 0, checksummed with the rest
STEP_DIR = re.compile(r"step_\d{8}")  # a checkpoint's own name: never step_N.tmp or step_N.corrupt-<k>
# A world-size-1 save or load passes no_dist=True, so torch's "assuming the intent is to save in a single process"
# says what was asked, at every checkpoint of every CPU run: silenced, that message only.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)
CRC_CHUNK = 16 << 20  # bytes read per crc32 update


class CheckpointCorrupt(ValueError):
    """A committed checkpoint whose files do not match their recorded checksums (or cannot be read)."""


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files this rank wrote into a checkpoint directory (rank 0 also DCP's .metadata)."""
    mine = [f for f in os.listdir(tmp) if f.startswith(f"__{rank}_") or f == f"rng_rank{rank}.pt"
            or (rank == 0 and f.startswith(RANK0_PREFIX))]
    return sorted(mine + ([".metadata"] if rank == 0 and os.path.exists(os.path.join(tmp, ".metadata")) else []))


def _checksums(tmp: str, dims: ParallelDims, group) -> dict | None:
    """{file: crc32} of the whole checkpoint on rank 0 (None elsewhere); each rank reads back its own files."""
    mine = {f: file_crc32(os.path.join(tmp, f)) for f in _own_files(tmp, dims.rank)}
    if dims.world_size == 1:
        return mine
    parts = [None] * dims.world_size if dims.rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    return {k: v for p in parts for k, v in p.items()} if dims.rank == 0 else None


def verify_checkpoint(path: str, meta: dict, dims: ParallelDims) -> None:
    """Re-check every recorded crc32 (file i on rank i mod world); raise CheckpointCorrupt on every rank if any
    file of any rank is missing or differs. A checkpoint written before checksums existed passes unchecked."""
    files = sorted(meta.get("files", {}))
    bad = [f for i, f in enumerate(files) if i % dims.world_size == dims.rank
           and (not os.path.exists(os.path.join(path, f)) or file_crc32(os.path.join(path, f)) != meta["files"][f])]
    n = torch.tensor([len(bad)])
    if dims.world_size > 1:
        dist.all_reduce(n, group=dims.side_group)   # CPU, gloo: the save's and load's checks all on the side group
    if int(n):
        raise CheckpointCorrupt(f"{path}: {int(n)} file(s) do not match their checksums"
                                f"{' (' + ', '.join(bad) + ')' if bad else ''}")


def _barrier(dims: ParallelDims, group=None) -> None:
    """The save's meeting points run on the gloo side group (long timeout, no NCCL communicator held up by a
    rank writing terabytes), as does DCP's own coordination (`process_group=`); an async save on its own
    gloo group (`group`)."""
    if dims.world_size > 1:
        dist.barrier(group=dims.side_group if group is None else group)


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


def _step_dirs(root: str) -> list[str]:
    """Names of the checkpoints under root, committed or not (step_N; never .tmp or moved-aside), oldest first."""
    return sorted(d for d in os.listdir(root) if STEP_DIR.fullmatch(d)) if os.path.isdir(root) else []


def latest_checkpoint(root: str) -> str | None:
    """Path of the newest committed checkpoint under root (None if there is none)."""
    done = [d for d in _step_dirs(root) if os.path.exists(os.path.join(root, d, META))]
    return os.path.join(root, done[-1]) if done else None


def move_aside(path: str) -> str:
    """Rename an unusable checkpoint to `step_N.corrupt-<k>` (the first k free), never deleting it: its files
    are the evidence, and its name is free again for the run to commit step N when it gets there."""
    k = 1
    while os.path.exists(f"{path}{CORRUPT_SUFFIX}{k}"):
        k += 1
    os.rename(path, f"{path}{CORRUPT_SUFFIX}{k}")
    _fsync_path(os.path.dirname(path) or ".")
    return f"{path}{CORRUPT_SUFFIX}{k}"


def _commit(tmp: str, final: str, root: str) -> None:
    """Rank 0: make the finished tmp directory the checkpoint (one atomic rename)."""
    _fsync_path(tmp)
    os.rename(tmp, final)
    _fsync_path(root)


class PendingSave:
    """A checkpoint being written by a thread (`save_checkpoint(async_save=True)`). `wait()` joins it and returns
    the checkpoint's path, or raises the writer's error (the checkpoint then stays uncommitted: `.tmp`)."""

    def __init__(self, path: str, write):
        self.path, self.error = path, None
        self.thread = threading.Thread(target=self._run, args=(write,), name=f"save {os.path.basename(path)}",
                                       daemon=True)
        self.thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as e:  # handed to the caller's wait(), which decides (every rank stops together)
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> str:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.path


def save_checkpoint(root: str, step: int, model, optimizer, dims: ParallelDims, extra: dict | None = None,
                    keep: int = 2, async_save: bool = False, group=None, files: dict | None = None):
    """Write the training state of every rank as checkpoint `step`; returns its path (same on all ranks), or
    with `async_save` a `PendingSave` writing it (module docstring: `wait()` before the next update). `group`:
    the gloo group of the save's collectives (default the side group; an async save needs one of its own).
    `files` (rank 0): {name: object} saved as `rank0_<name>` inside the checkpoint, before its commit (tensors,
    lists, dicts, numbers and strings: what `load_file` reads back with weights_only=True)."""
    final = os.path.join(root, f"{STEP_PREFIX}{step:08d}")
    tmp = final + TMP_SUFFIX
    if dims.rank == 0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):  # debris of a crashed save (ours or an older one)
            if d.endswith(TMP_SUFFIX):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        os.makedirs(tmp)
    _barrier(dims, group)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}   # views of the live tensors
    rng = _rng_state()                                                        # as of now, not of the write

    def write():
        _write(root, tmp, final, step, state, rng, dims, extra, keep, group, files)
    if not async_save:
        write()
        return final
    return PendingSave(final, write)


def _write(root: str, tmp: str, final: str, step: int, state: dict, rng: dict, dims: ParallelDims, extra, keep: int,
           group, files: dict | None = None) -> None:
    """DCP's write, this rank's RNG states, the checksums; rank 0 commits (meta.json, rename) and prunes."""
    dcp.save(state, checkpoint_id=tmp, no_dist=dims.world_size == 1,
             process_group=dims.side_group if group is None else group)
    rng_path = os.path.join(tmp, f"rng_rank{dims.rank}.pt")
    torch.save(rng, rng_path)
    _fsync_path(rng_path)
    for name, obj in (files or {}).items() if dims.rank == 0 else ():
        path = os.path.join(tmp, RANK0_PREFIX + name)
        torch.save(obj, path)
        _fsync_path(path)
    _barrier(dims, group)
    files = _checksums(tmp, dims, dims.side_group if group is None else group)
    if dims.rank == 0:
        meta = {"step": step, "pp": dims.pp, "ep": dims.ep, "dp": dims.dp, "world_size": dims.world_size,
                "extra": extra or {}, "files": files}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, final, root)
        _prune(root, keep)
    _barrier(dims, group)


def load_file(path: str, name: str):
    """The object `save_checkpoint(files={name: ...})` stored in checkpoint `path`, or None if it has none
    (verified with the rest of the checkpoint by `load_checkpoint`; read with weights_only=True)."""
    p = os.path.join(path, RANK0_PREFIX + name)
    return torch.load(p, weights_only=True) if os.path.exists(p) else None


def _prune(root: str, keep: int) -> None:
    done = _step_dirs(root)  # moved-aside checkpoints are never pruned (nor counted)
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json, checked for the structure `save_checkpoint` writes (step and world_size ints,
    files {name: crc32}, extra a dict); anything else is CheckpointCorrupt naming the file (-> fall-back)."""
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path} is not a committed checkpoint (no {META}); an interrupted save?")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{meta_path} is not readable JSON: {e}") from e
    files = meta.get("files", {}) if isinstance(meta, dict) else None
    if not (isinstance(meta, dict) and type(meta.get("step")) is int and type(meta.get("world_size")) is int
            and isinstance(meta.get("extra", {}), dict) and isinstance(files, dict)
            and all(isinstance(k, str) and type(v) is int for k, v in files.items())):
        raise CheckpointCorrupt(f"{meta_path} is not a checkpoint's meta.json (want step and world_size ints, "
                                f"files {{name: crc32}}, extra {{...}}): {str(meta)[:120]}")
    return meta


def load_checkpoint(path: str, model, optimizer, dims: ParallelDims) -> dict:
    """Load a checkpoint written by `save_checkpoint` under any PP/EP/DP layout; returns its meta dict."""
    meta = read_meta(path)
    verify_checkpoint(path, meta, dims)
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    try:
        dcp.load(state, checkpoint_id=path, no_dist=dims.world_size == 1, process_group=dims.side_group)
    except (Exception, CheckpointException) as e:  # DCP names the bad key; add the checkpoint (a BaseException)
        raise ValueError(f"cannot load {path} into this model/optimizer: {e}") from e
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    rng_path = os.path.join(path, f"rng_rank{dims.rank}.pt")
    if meta["world_size"] == dims.world_size and os.path.exists(rng_path):
        try:   # tensors and ints only (weights_only): cannot run code; a file of another shape is corrupt
            _set_rng_state(torch.load(rng_path, weights_only=True))
        except Exception as e:
            raise CheckpointCorrupt(f"{rng_path} is not an RNG state ({type(e).__name__}: {e})") from e
    return meta


def tidy(root: str, unusable: dict, newer_than: str, dims: ParallelDims, log=print) -> None:
    """Rank 0, at start-up: move aside every unusable checkpoint newer than the one resumed ({path: why}; one
    line each, naming where it went: `move_aside`) and remove a crashed save's `.tmp` debris; every rank meets
    after. Left in place, an unusable `step_N/` makes the commit of step N, when the run reaches it again, fail
    ("Directory not empty") on every restart."""
    if dims.rank == 0 and os.path.isdir(root):
        for bad in sorted(p for p in unusable if p > newer_than):
            log(f"checkpoint {bad} is unusable ({unusable[bad]}); moved aside to {move_aside(bad)} (kept, never "
                f"read again){'; resuming from ' + newer_than if newer_than else ''}")
        for t in sorted(t for t in os.listdir(root) if t.startswith(STEP_PREFIX) and t.endswith(TMP_SUFFIX)):
            shutil.rmtree(os.path.join(root, t), ignore_errors=True)
            log(f"removed {os.path.join(root, t)}: the debris of a save that did not finish")
    _barrier(dims)


def load_latest(root: str, model, optimizer, dims: ParallelDims, log=print) -> tuple[str | None, dict | None]:
    """Resume from the newest checkpoint under root that verifies and loads; a corrupt or unreadable one is
    reported and the previous one tried. Returns (path, meta), or (None, None) if root has none. If every
    checkpoint fails, each is reported and the last error raised (nothing usable is silently skipped into a
    fresh start, and nothing is moved: the next start fails the same way).

    Once one loads (or when root has no committed checkpoint at all), every newer `step_N/` -- unusable, or
    without meta.json (never committed by a save) -- is moved aside and `.tmp` debris removed (`tidy`)."""
    names = _step_dirs(root)
    done = [d for d in names if os.path.exists(os.path.join(root, d, META))]
    err, unusable = None, {os.path.join(root, d): f"no {META}: never committed" for d in names if d not in done}
    for d in reversed(done):
        path = os.path.join(root, d)
        try:
            meta = load_checkpoint(path, model, optimizer, dims)
        except ValueError as e:  # CheckpointCorrupt or a DCP read error: fall back to the previous one
            err, unusable[path] = e, str(e)
            continue
        tidy(root, unusable, path, dims, log)
        return path, meta
    if err is not None:
        if dims.rank == 0:
            for bad in sorted(unusable):
                log(f"checkpoint {bad} is unusable ({unusable[bad]})")
        raise err
    tidy(root, unusable, "", dims, log)
    return None, None


def export_hf(path: str, cfg, out_dir: str, dtype=torch.bfloat16, **save_kw) -> dict:
    """Offline export: a DCP checkpoint of any layout -> one full model in host memory (built on meta, then
    materialised in `dtype`) -> the official HF layout via `nanoflash.checkpoint.save_hf_checkpoint`.
    For flash in bf16 this needs ~545 GB of host memory (see the planner)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.cast_(dtype).to_empty(device="cpu")
    load_checkpoint(path, model, None, ParallelDims())
    return save_hf_checkpoint(model, out_dir, **save_kw)

"""Every file of a DCP checkpoint is under a checksum, and a flipped byte in any of them is refused on load
(nanoflash.parallel.dcp).

Contract (dcp.py): meta.json, written last, records a crc32 of every other file of the step directory
("files"); `load_checkpoint` re-verifies them all and raises `CheckpointCorrupt` naming the file; `load_latest`
then falls back to the previous checkpoint. The existing test flips a byte in `__0_0.distcp` only, so a file
left out of the checksums (DCP's `.metadata`, an `rng_rank{r}.pt`, a second rank's shard) passed the suite.
Here the reference is the directory listing itself and `zlib.crc32` of each file's bytes; each file in turn gets
a byte flipped, in a fresh copy of the checkpoint.

meta.json cannot hold its own checksum: it is the root of trust. A torn (unparseable) meta.json is refused; a
flipped digit inside a value could pass unnoticed -- a known limit of the format, not tested here.

Run: pytest tests/test_checkpoint_checksums.py -q
"""
import json
import os
import shutil
import zlib

import pytest
import torch

from conftest import run_ranks
from nanoflash.config import OptimConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import CheckpointCorrupt, load_checkpoint, load_latest, save_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.pipeline import build_stage
from nanoflash.parallel.train_step import make_optimizer

META = "meta.json"


def _crc(path):
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _flip(path, at=None):
    size = os.path.getsize(path)
    at = size // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def _assert_all_covered(path):
    """Every file but meta.json is in meta["files"] with the crc32 of its bytes, and nothing else is listed."""
    with open(os.path.join(path, META)) as f:
        files = json.load(f)["files"]
    on_disk = sorted(f for f in os.listdir(path) if f != META)
    assert sorted(files) == on_disk, f"checksummed {sorted(files)} but the directory holds {on_disk}"
    for name in on_disk:
        assert files[name] == _crc(os.path.join(path, name)), f"{name}: recorded crc32 is not the file's"
    return on_disk


def _assert_each_flip_refused(path, tmp_path, model):
    """A byte flipped in each file in turn (a fresh copy each time): load_checkpoint raises naming the file
    (before it reads anything, so one model serves every try)."""
    for name in sorted(f for f in os.listdir(path) if f != META):
        copy = str(tmp_path / f"flip_{name.strip('.')}")
        shutil.copytree(path, copy)
        _flip(os.path.join(copy, name))
        with pytest.raises(CheckpointCorrupt, match=name.replace(".", r"\.")):
            load_checkpoint(copy, model, None, ParallelDims())
        shutil.rmtree(copy)


def _tiny(seed=0):
    return Transformer(preset("tiny")).init_weights(seed)


def test_every_file_of_a_single_process_checkpoint_is_checksummed_and_checked(tmp_path):
    """Bug caught: a file of the step directory left out of the checksums (`.metadata`, `rng_rank0.pt`, a
    shard): it is missing from meta["files"], and a flipped byte in it loads silently."""
    model = _tiny()
    path = save_checkpoint(str(tmp_path / "ck"), 1, model, make_optimizer(model, OptimConfig()), ParallelDims())
    files = _assert_all_covered(path)
    assert ".metadata" in files and "rng_rank0.pt" in files and any(f.endswith(".distcp") for f in files)
    _assert_each_flip_refused(path, tmp_path, _tiny(1))


def test_torn_meta_json_is_refused_and_load_latest_falls_back(tmp_path):
    """Bug caught: an unreadable meta.json of the newest checkpoint taken as a fresh start or a crash, instead
    of the fall back to the previous checkpoint the contract promises."""
    root = str(tmp_path / "ck")
    for step in (1, 2):
        model = _tiny(step)
        save_checkpoint(root, step, model, make_optimizer(model, OptimConfig()), ParallelDims(), keep=5)
    newest = os.path.join(root, "step_00000002")
    os.truncate(os.path.join(newest, META), os.path.getsize(os.path.join(newest, META)) // 2)
    with pytest.raises(ValueError):
        load_checkpoint(newest, _tiny(), None, ParallelDims())
    path, meta = load_latest(root, _tiny(9), None, ParallelDims(), log=lambda m: None)
    assert meta["step"] == 1 and path.endswith("step_00000001")


def _save_pp2(rank, world, root):
    dims = ParallelDims(pp=2)
    model = _tiny()
    build_stage(model, dims, (1, 3))
    save_checkpoint(root, 3, model, make_optimizer(model, OptimConfig()), dims)
    return sorted(os.listdir(os.path.join(root, "step_00000003")))


def test_every_rank_file_of_a_two_rank_checkpoint_is_checksummed_and_checked(tmp_path):
    """Bug caught: only rank 0's files checksummed (the other rank's shard and RNG file gathered wrong or not
    at all): a flipped byte in `__1_0.distcp` or `rng_rank1.pt` would load silently."""
    root = str(tmp_path / "pp2")
    run_ranks(_save_pp2, 2, root)
    path = os.path.join(root, "step_00000003")
    files = _assert_all_covered(path)
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= set(files), files
    assert sum(f.endswith(".distcp") for f in files) >= 2, files
    _assert_each_flip_refused(path, tmp_path, _tiny(1))

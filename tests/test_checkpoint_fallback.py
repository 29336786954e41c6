"""Falling back past an unusable checkpoint never crash-loops and never loses it (issue 39 item 1).

`load_latest` resumes from step N-1 when step_N is unusable (a bad crc, a missing shard, a torn or missing
meta.json). The run then reaches step N again and commits `step_N.tmp -> step_N`: with the unusable `step_N/`
still in place that rename failed ("Directory not empty") on every restart. The unusable checkpoint is now
moved aside as `step_N.corrupt-<k>` (never deleted: its files are evidence), named once in the log; a crashed
save's `.tmp` debris is removed at start-up.

Run: pytest tests/test_checkpoint_fallback.py -q
"""
import json
import os

import pytest

from nanoflash.config import OptimConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import CheckpointCorrupt, latest_checkpoint, load_latest, save_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.train_step import make_optimizer

KEEP = 3  # the smoke recipe's --train.keep in the repro


def _model(seed=0):
    return Transformer(preset("tiny")).init_weights(seed)


def _save(root, step, seed=None, keep=KEEP):
    model = _model(step if seed is None else seed)
    return save_checkpoint(str(root), step, model, make_optimizer(model, OptimConfig()), ParallelDims(),
                           extra={"data_pos": step}, keep=keep)


def _overwrite_8_bytes(path):
    """The issue's repro: 8 bytes inside the newest checkpoint's shard."""
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xde\xad\xbe\xef" * 2)


def _resume(root, messages):
    model = _model(99)
    return load_latest(str(root), model, make_optimizer(model, OptimConfig()), ParallelDims(), log=messages.append)


@pytest.mark.parametrize("fault", ["bad_crc", "missing_shard", "torn_meta", "no_meta"])
def test_fallback_then_reaching_the_step_again_saves(tmp_path, fault):
    """Bug caught: the unusable step_4/ left in place, so the next save of step 4 fails with "Directory not
    empty" (OSError from os.rename) on every restart; and (no_meta) a step_N without meta.json, which
    load_latest never even looks at, blocking the save the same way."""
    for s in (2, 3, 4):
        _save(tmp_path, s)
    bad = os.path.join(tmp_path, "step_00000004")
    if fault == "bad_crc":
        _overwrite_8_bytes(bad)
    elif fault == "missing_shard":
        os.remove(os.path.join(bad, "__0_0.distcp"))
    elif fault == "torn_meta":
        with open(os.path.join(bad, "meta.json"), "r+") as f:
            f.truncate(10)
    else:
        os.remove(os.path.join(bad, "meta.json"))
    files_before = sorted(os.listdir(bad))
    for restart in range(2):  # the "run --steps 6 twice"
        messages = []
        path, meta = _resume(tmp_path, messages)
        assert path.endswith("step_00000006" if restart else "step_00000003"), (restart, path)
        if restart == 0:
            assert meta["step"] == 3
            moved = [m for m in messages if "step_00000004.corrupt-1" in m and "step_00000003" in m]
            assert len(moved) == 1 and len(messages) == 1, messages  # once: why, where it went, what resumed
            _save(tmp_path, 4)  # the run reaches step 4 again: this save used to raise
            _save(tmp_path, 5)
            _save(tmp_path, 6)
        else:
            assert meta["step"] == 6 and messages == [], messages
    aside = os.path.join(tmp_path, "step_00000004.corrupt-1")
    assert sorted(os.listdir(aside)) == files_before, "the unusable checkpoint must be kept, untouched"
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000006")
    kept = sorted(d for d in os.listdir(tmp_path))
    assert kept == ["step_00000004", "step_00000004.corrupt-1", "step_00000005", "step_00000006"], kept


def test_a_second_corrupt_copy_of_the_same_step_gets_the_next_number(tmp_path):
    """Bug caught: moving aside onto an existing step_N.corrupt-1 (rename fails, or the evidence is replaced)."""
    _save(tmp_path, 1)
    for k in (1, 2):
        _overwrite_8_bytes(_save(tmp_path, 2))
        messages = []
        path, _ = _resume(tmp_path, messages)
        assert path.endswith("step_00000001")
        assert os.path.isdir(os.path.join(tmp_path, f"step_00000002.corrupt-{k}")), os.listdir(tmp_path)
    assert not os.path.exists(os.path.join(tmp_path, "step_00000002"))


def test_nothing_is_moved_when_every_checkpoint_is_unusable(tmp_path):
    """Bug caught: moving every checkpoint aside when none loads, so that the next start finds none and starts
    fresh (the silent restart that raising prevents)."""
    _overwrite_8_bytes(_save(tmp_path, 1))
    with pytest.raises(CheckpointCorrupt):
        _resume(tmp_path, [])
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]


def test_save_debris_is_removed_at_start_up(tmp_path):
    """Bug caught: a crashed save's step_N.tmp left until the next save (a disk full of half checkpoints for a
    run that crashes before saving again)."""
    _save(tmp_path, 1)
    debris = os.path.join(tmp_path, "step_00000002.tmp")
    os.makedirs(debris)
    with open(os.path.join(debris, "__0_0.distcp"), "wb") as f:
        f.write(b"half")
    messages = []
    path, _ = _resume(tmp_path, messages)
    assert path.endswith("step_00000001")
    assert not os.path.exists(debris), os.listdir(tmp_path)
    assert any("step_00000002.tmp" in m for m in messages), messages


def test_moved_aside_checkpoints_are_never_pruned_nor_resumed(tmp_path):
    """Bug caught: a `step_N.corrupt-1` picked as the newest checkpoint (it sorts after step_N-1: a restart
    before step N is saved again would load the corrupt copy, or fall back with a message every time), or
    counted by the pruning (deleting evidence, or a good checkpoint in its place)."""
    _save(tmp_path, 1, keep=2)
    _overwrite_8_bytes(_save(tmp_path, 2, keep=2))
    _resume(tmp_path, [])
    messages = []
    path, _ = _resume(tmp_path, messages)  # a restart before step 2 is saved again
    assert path.endswith("step_00000001") and messages == [], messages
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000001")
    for s in (2, 3, 4):
        _save(tmp_path, s, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002.corrupt-1", "step_00000003", "step_00000004"]
    with open(os.path.join(tmp_path, "step_00000002.corrupt-1", "meta.json")) as f:
        assert json.load(f)["step"] == 2


def test_a_step_dir_without_meta_is_moved_aside_on_a_fresh_start(tmp_path):
    """Bug caught: with no committed checkpoint at all (a fresh start), a `step_1/` without meta.json kept, so
    the run's first save of step 1 fails ("Directory not empty")."""
    os.makedirs(os.path.join(tmp_path, "step_00000001"))
    messages = []
    assert load_latest(str(tmp_path), None, None, ParallelDims(), log=messages.append) == (None, None)
    assert len(messages) == 1 and "step_00000001.corrupt-1" in messages[0], messages
    _save(tmp_path, 1)


@pytest.fixture(scope="module")
def one_save(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("one"), 3)


@pytest.mark.parametrize("fault", ["meta_a_list", "meta_files_a_list", "meta_no_step", "rng_forged_crc"])
def test_a_malformed_meta_or_rng_file_is_corrupt_not_a_traceback(one_save, tmp_path, fault):
    """Issue 39 (low). Bug caught: a meta.json of the wrong structure (AttributeError / KeyError / TypeError) or
    an RNG file replaced along with its crc in meta.json (weights_only unpickling or set_rng_state failing)
    raised a raw exception, which `load_latest` does not catch: no fall-back to the previous checkpoint. Now
    each is CheckpointCorrupt naming the file (the fall-back itself: the tests above)."""
    import shutil
    import torch
    from nanoflash.parallel.dcp import file_crc32, load_checkpoint
    bad = str(tmp_path / "step_00000003")
    shutil.copytree(one_save, bad)
    with open(os.path.join(bad, "meta.json")) as f:
        meta = json.load(f)
    if fault == "meta_a_list":
        meta = [meta]
    elif fault == "meta_files_a_list":
        meta["files"] = sorted(meta["files"])
    elif fault == "meta_no_step":
        del meta["step"]
    else:   # another valid pickle where the RNG state was, its crc forged to match
        rng = os.path.join(bad, "rng_rank0.pt")
        torch.save({"torch": torch.zeros(3)}, rng)
        meta["files"]["rng_rank0.pt"] = file_crc32(rng)
    with open(os.path.join(bad, "meta.json"), "w") as f:
        json.dump(meta, f)
    model = _model(99)
    with pytest.raises(CheckpointCorrupt, match="rng_rank0.pt" if fault.startswith("rng") else "meta.json"):
        load_checkpoint(bad, model, make_optimizer(model, OptimConfig()), ParallelDims())

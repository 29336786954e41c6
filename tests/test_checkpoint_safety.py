"""Checkpoints that cannot run code, catch corruption and fall back to the last good one; runs that never adopt
another run's checkpoints; diverged runs that stop with one message (nanoflash.parallel.dcp, train.py).

Each test reproduces the fault: a crafted RNG pickle, a flipped byte in a DCP shard, a corrupt newest
checkpoint, NaN inside an HF checkpoint, `--train.resume false` into an old run's folder, `--optim.lr 1e30`.

Run: pytest tests/test_checkpoint_safety.py -q
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from nanoflash.checkpoint import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from nanoflash.config import OptimConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import CheckpointCorrupt, file_crc32, load_checkpoint, load_latest, save_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.train_step import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0):
    return Transformer(preset("tiny")).init_weights(seed)


def _save(root, step, seed=0):
    model = _model(seed)
    opt = make_optimizer(model, OptimConfig())
    return save_checkpoint(str(root), step, model, opt, ParallelDims(), extra={"data_pos": step}, keep=5), model


class _Exploit:
    """Unpickling this runs a command (what a crafted rng_rank0.pt would carry)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_crc(path, name):
    """What an attacker (or a careless copy) can do too: make meta.json's checksum match the new bytes."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    meta["files"][name] = file_crc32(os.path.join(path, name))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_crafted_rng_file_cannot_run_code(tmp_path):
    path, _ = _save(tmp_path / "c", 1)
    marker = tmp_path / "pwned"
    torch.save({"torch": torch.get_rng_state(), "python": _Exploit(str(marker))}, os.path.join(path, "rng_rank0.pt"))
    _rewrite_crc(path, "rng_rank0.pt")
    model = _model(1)
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|unsupported"):
        load_checkpoint(path, model, None, ParallelDims())
    assert not marker.exists(), "the crafted pickle executed a command"


def test_flipped_byte_in_a_shard_is_detected(tmp_path):
    path, _ = _save(tmp_path / "c", 1)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointCorrupt, match="__0_0.distcp"):
        load_checkpoint(path, _model(1), None, ParallelDims())


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    _, good = _save(tmp_path, 1, seed=3)
    newest, _ = _save(tmp_path, 2, seed=4)
    os.truncate(os.path.join(newest, "__0_0.distcp"), 100)  # a torn file
    messages = []
    model = _model(9)
    path, meta = load_latest(str(tmp_path), model, None, ParallelDims(), log=messages.append)
    assert meta["step"] == 1 and path.endswith("step_00000001")
    assert len(messages) == 1 and "step_00000002" in messages[0] and "checksum" in messages[0]
    for k, v in good.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    only, _ = _save(tmp_path, 1)
    os.truncate(os.path.join(only, "__0_0.distcp"), 10)
    with pytest.raises(CheckpointCorrupt):
        load_latest(str(tmp_path), _model(), None, ParallelDims(), log=lambda m: None)


def test_nan_in_hf_checkpoint_names_the_tensor_and_file(tmp_path):
    model = _model()
    with torch.no_grad():
        model.layers["2"].attn.wq_b.weight[1, 2] = float("nan")
    save_hf_checkpoint(model, str(tmp_path / "hf"), weights="bf16")
    with torch.device("meta"):
        dst = Transformer(preset("tiny"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wq_b\.weight in .*\.safetensors holds NaN/inf"):
        load_hf_checkpoint(dst, str(tmp_path / "hf"))


def _train(out, *extra, check=True):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", str(out),
           "--train.progress", "false", "--train.plots", "false", "--eval.every", "0", "--train.warmup_steps", "0",
           *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_no_resume_into_an_old_runs_folder_is_refused(tmp_path):
    _train(tmp_path / "run", "--steps", "1")
    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    p = _train(tmp_path / "run", "--steps", "2", "--train.resume", "false", check=False)
    assert p.returncode != 0 and "holds checkpoints of an earlier run" in p.stderr, p.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before  # nothing pruned or added


def test_diverging_learning_rate_stops_with_one_message(tmp_path):
    """lr 1e30: the first update leaves finite weights of ~1e30. The run stops right after that update naming
    it (train.max_abs_weight), before any push or save: the last checkpoint stays the step-0 one. Bug caught
    (issue 39 case 6): the exploded weights passed the finiteness check, were pushed and saved as step 1, and
    every resume then failed with "non-finite logits"."""
    out = tmp_path / "lr"
    p = _train(out, "--steps", "4", "--optim.lr", "1e30", "--grpo.dynamic_sampling", "false", check=False)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("diverged: ") and "exploded past |w| 10000 (train.max_abs_weight) after the " \
        "optimizer update (lr 1e+30)" in last and "lower --optim.lr" in last, p.stderr[-2000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000000"]    # step 1 was never saved
    assert "step 1:" not in p.stdout                                       # nor logged as a finished step


def test_torn_last_metrics_line_is_dropped_a_corrupt_middle_line_is_an_error(tmp_path, capsys):
    from nanoflash.rl.metrics import MetricsLog, read_jsonl
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tra')  # killed mid-write
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]
    assert "torn last line" in capsys.readouterr().err
    log = MetricsLog(str(path), resume_step=2)  # the resume path reads the same file
    log.close()
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2]
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tra\n{"kind": "train", "step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_jsonl(str(path))

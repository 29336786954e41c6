"""Asynchronous checkpoint saves (issue 37 item 4): written by a thread while the next step's rollout runs.

In process, world size 1 (fast): a save held in its writer is not committed (the previous checkpoint is the
newest), holds the state and the RNG of the moment it was taken, and resumes exactly once written; a writer
that fails leaves `step_N.tmp`, and resuming falls back to the previous checkpoint and removes the debris;
`Trainer.step` waits for a save in flight before anything changes the weights.
Through train.py (slow: `-m slow`): a save that overlaps the next step's rollout (forced: its writer waits for
that rollout) resumes exactly, and a run killed while an async save is being written resumes from the previous
checkpoint and ends with the uninterrupted run's state (tests/save_probe.py holds the writers).

Run: pytest tests/test_checkpoint_async.py -q   (the slow ones: -m slow, about 2 min on 2 cores)
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import TIMING_KEYS

from nanoflash import grpo
from nanoflash.cli import parse_args
from nanoflash.config import OptimConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel import dcp
from nanoflash.parallel.dcp import latest_checkpoint, load_latest, save_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.parallel.train_step import make_optimizer
from nanoflash.rl import trainer
from nanoflash.rl.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0):
    model = Transformer(preset("tiny")).init_weights(seed)
    return model, make_optimizer(model, OptimConfig(lr=1e-3))


def _load(path):
    model, opt = _model(99)
    meta = dcp.load_checkpoint(path, model, opt, ParallelDims())
    return meta, model.state_dict(), opt.state_dict()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) if torch.is_tensor(v) else v == b[k] for k, v in a.items())


def test_async_saves_commit_when_written_and_a_failed_one_falls_back(tmp_path, monkeypatch):
    """1. A save held in its writer is not committed (the previous checkpoint stays the newest); once written it
    holds the state and the RNG of its start, although the run drew numbers meanwhile. Bugs caught: the RNG
    states taken by the writer thread (a resume would then draw differently); a commit before the write.
    2. A writer that dies after DCP wrote its shards (a crash mid-save, in process): wait() raises, nothing is
    committed, and resuming loads the previous checkpoint and removes step_N.tmp. Bug caught: a commit that does
    not wait for the writer's success."""
    root, dims = str(tmp_path), ParallelDims()
    model, opt = _model()
    release, run = threading.Event(), dcp.PendingSave._run   # the writer thread holds before doing anything
    monkeypatch.setattr(dcp.PendingSave, "_run", lambda self, write: (release.wait(30), run(self, write)))
    torch.manual_seed(7)
    rng_at_save = torch.get_rng_state()
    pending = save_checkpoint(root, 1, model, opt, dims, extra={"data_pos": 1}, async_save=True)
    torch.rand(1000)                                    # the next step's draws while the save is being written
    time.sleep(0.2)
    assert not pending.done() and latest_checkpoint(root) is None and os.listdir(root) == ["step_00000001.tmp"]
    release.set()
    assert pending.wait().endswith("step_00000001") and latest_checkpoint(root) == pending.path
    meta, m, o = _load(pending.path)
    assert meta["extra"] == {"data_pos": 1} and _equal(m, model.state_dict()) and _equal(o, opt.state_dict())
    assert torch.equal(torch.get_rng_state(), rng_at_save)   # load_checkpoint restored the RNG of the save's start

    real = dcp.dcp.save

    def dies_after_writing(*a, **k):
        real(*a, **k)
        raise OSError("No space left on device (simulated)")
    monkeypatch.setattr(dcp.dcp, "save", dies_after_writing)
    pending = save_checkpoint(root, 2, model, opt, dims, async_save=True)
    with pytest.raises(OSError, match="simulated"):
        pending.wait()
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002.tmp"]
    resumed, o = _model(99)
    messages = []
    path, meta = load_latest(root, resumed, o, dims, log=messages.append)
    assert path.endswith("step_00000001") and meta["extra"] == {"data_pos": 1}
    assert sorted(os.listdir(root)) == ["step_00000001"] and "debris" in messages[0]


def test_the_next_step_waits_for_the_save_before_the_update(tmp_path):
    """Bug caught: `Trainer.step` updating the weights while the writer still reads them (the checkpoint then
    mixes two steps' weights): the save in flight must be waited for before the step's log-probs and update."""
    cfg = parse_args(["--recipe", "smoke", "--train.async_save", "true"])
    t = trainer.Trainer(cfg, preset("tiny", **cfg.model), ParallelDims())
    t.start_optimizer()
    order = []

    class Pending:
        path = "step"

        def wait(self):
            order.append("save finished")
    t.logprobs = lambda shard: order.append("log-probs") or torch.zeros_like(shard.rollout_logprobs)
    t.train = lambda shard: order.append("update") or {}
    t.pending_save = Pending()
    eps = [grpo.Episode([3, 4, 5], [6, 7], [-0.5, -0.7], float(i % 2), 0) for i in range(4)]
    t.step(grpo.pack(eps, torch.tensor([1.0, -1.0, 1.0, -1.0])), 1)
    assert order == ["save finished", "log-probs", "update"] and t.pending_save is None


# ---------------------------------------------------------------------------------------------- through train.py
def _probe(out: str, mode: str, *extra: str, wait: bool = True):
    cmd = [sys.executable, os.path.join(ROOT, "tests", "save_probe.py"), mode, "--recipe", "smoke", "--out", out,
           "--train.progress", "false", "--train.plots", "false", "--rollout.weights", "fp32",
           "--train.async_save", "true", *extra]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{mode} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _kill_when_written(proc, path: str, timeout_s: float = 240) -> None:
    """SIGKILL `proc` as soon as `path` exists (the run must get there: else its stderr is the failure)."""
    deadline = time.time() + timeout_s
    while not os.path.exists(path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.exists(path), proc.stderr.read()[-2000:]


def _final_state(out: str):
    return _load_smoke(latest_checkpoint(os.path.join(out, "checkpoints")))


def _load_smoke(path):
    cfg = parse_args(["--recipe", "smoke"])
    model = trainer.build_model(preset("tiny", **cfg.model), ParallelDims(), cfg.parallel, torch.float32, "cpu")
    opt = trainer.make_optimizer(model, cfg.optim)
    meta = dcp.load_checkpoint(path, model, opt, ParallelDims())
    return meta, model.state_dict(), opt.state_dict()


def _no_timing(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS and not k.endswith(("_s", "_per_s"))}


def _same_run(extra: dict) -> dict:
    """A checkpoint's `extra` without what names the directory it was written to (two runs, two --out)."""
    cfg = {**extra["run_config"], "train": {k: v for k, v in extra["run_config"]["train"].items() if k != "out_dir"}}
    return {**extra, "run_config": cfg}


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    """The smoke recipe (3 steps, a checkpoint a step) with every async save held until the next step's
    rollout has begun (or, for the last one, until the run waits for it)."""
    out = str(tmp_path_factory.mktemp("async") / "full")
    _probe(out, "overlap")
    return out


@pytest.mark.slow
def test_a_save_overlapping_the_next_rollout_resumes_exactly(overlapped, tmp_path):
    """Each checkpoint but the last was still being written when the next step's rollout began (the probe's
    log), and a run killed right after checkpoint 2 was committed -- during step 3's rollout -- resumes to the
    same metrics, weights and optimizer state as the uninterrupted run, bit for bit. Bug caught: the writer
    reading weights the next update had already changed (no wait in `Trainer.step`)."""
    log = [json.loads(x) for x in open(os.path.join(overlapped, "save_probe.jsonl"))]
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    assert [r["released_by"] for r in log] == ["rollout", "rollout", "rollout", "wait"], log
    split = str(tmp_path / "split")
    target = os.path.join(split, "checkpoints", "step_00000002", "meta.json")
    _kill_when_written(_probe(split, "overlap", wait=False), target)
    out = _probe(split, "plain")
    assert "resumed from" in out and "step 2" in out
    a, b = (read_jsonl(os.path.join(d, "metrics.jsonl"), "train") for d in (overlapped, split))
    assert [_no_timing(r) for r in a] == [_no_timing(r) for r in b]
    (meta_a, model_a, opt_a), (meta_b, model_b, opt_b) = _final_state(overlapped), _final_state(split)
    assert meta_a["step"] == meta_b["step"] == 3 and _same_run(meta_a["extra"]) == _same_run(meta_b["extra"])
    assert _equal(model_a, model_b) and _equal(opt_a, opt_b)


@pytest.mark.slow
def test_a_run_killed_during_an_async_save_resumes_from_the_previous_checkpoint(overlapped, tmp_path):
    """SIGKILL while checkpoint 2 is being written (its writer holds after DCP's shards are on disk, before the
    checksums): step_2 stays step_2.tmp, the restart resumes from step 1 (the newest committed), removes the
    debris, redoes steps 2 and 3 and ends with the uninterrupted run's state. Bug caught: a checkpoint committed
    before its files are checked (the restart would resume from an unverified step 2)."""
    split = str(tmp_path / "crash")
    _kill_when_written(_probe(split, "crash:2", wait=False), os.path.join(split, "save_blocked"))
    ckpts = sorted(os.listdir(os.path.join(split, "checkpoints")))
    assert ckpts == ["step_00000000", "step_00000001", "step_00000002.tmp"], ckpts
    out = _probe(split, "plain")
    assert "resumed from" in out and "step 1" in out and "debris" in out
    (meta_a, model_a, opt_a), (meta_b, model_b, opt_b) = _final_state(overlapped), _final_state(split)
    assert meta_b["step"] == 3 and _same_run(meta_a["extra"]) == _same_run(meta_b["extra"])
    assert _equal(model_a, model_b) and _equal(opt_a, opt_b)

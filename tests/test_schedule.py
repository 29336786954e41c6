"""Issue 41 item 4: the one-step-off schedule (`rl/schedule.py`) -- step k+1's rollout beside step k, the push
at the boundary, staleness bounded by rollout.max_staleness, and a checkpoint that holds the pending rollout --
and the kill -9 and resume of an asynchronous train.py run (no sample lost, none trained twice).

The fast tests drive the schedule with a scripted collector that records, for every rollout, the weights the
servers held when it started and whether a push happened while it ran. The e2e test is `slow` (three smoke
runs, ~1 min on 2 cores): `pytest tests/test_schedule.py -m slow -q`.

Run: `pytest tests/test_schedule.py -q`.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from nanoflash import grpo
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.parallel.dcp import latest_checkpoint, load_checkpoint
from nanoflash.parallel.dims import ParallelDims
from nanoflash.rl import trainer
from nanoflash.rl.metrics import read_jsonl
from nanoflash.rl.schedule import OneStepOff, Synchronous, make_schedule
from nanoflash.sglang.client import ServerGoneError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Rollouts:
    """A collector stand-in: rollout k takes `seconds`, uses the positions [10k, 10k + 10), returns a one-row
    batch whose first token is k and records (k, the weights served when it started); `pushes_during` counts pushes that came
    while one ran."""

    def __init__(self, seconds=0.05):
        self.seconds, self.served, self.started, self.running = seconds, None, [], threading.Event()
        self.pushes_during, self.client, self.cancel, self.carried = 0, None, threading.Event(), []

    def next_batch(self, at):
        self.running.set()
        self.started.append((at, self.served))
        time.sleep(self.seconds)
        self.running.clear()
        batch = grpo.pack([grpo.Episode([at], [1], [-0.5], 1.0, at)], [1.0])   # input_ids[0, 0] names the step
        return batch, {"trained_groups": list(range(10 * at, 10 * at + 10))}

    def state_dict(self):
        return {"carry": list(self.carried)}

    def load_state_dict(self, state):
        self.carried = state["carry"]


def rc(asynchronous=True, s=1):
    return types.SimpleNamespace(asynchronous=asynchronous, max_staleness=s)


def drive(sched, col, steps, start=0, eval_every=0, stop_after=None):
    """train.py's loop, without training: take, push when due (after the boundary), -> trained steps."""
    out = []
    for step in range(start + 1, steps + 1):
        batch, m = sched.take(step)
        assert int(batch.input_ids[0, 0]) == step, batch
        out.append((step, m["trained_groups"]))
        needed = step == steps or bool(eval_every and step % eval_every == 0)
        if sched.push_due(step, needed):
            sched.boundary()
            if col.running.is_set():
                col.pushes_during += 1
            sched.pushed(step)
        if stop_after == step:
            break
    return out


def test_one_step_off_overlaps_and_never_pushes_during_a_rollout():
    """Rollout k+1 starts before step k trains (on the weights of step k-1: staleness 1 from step 2 on), and
    every push waits for it. Bugs caught: a push while the next rollout runs (weights changing under its
    requests), rollouts started late (no overlap), a rollout started past the last step."""
    col = Rollouts()
    sched = OneStepOff(col, rc(), 5, ParallelDims(), served=0)
    trained = drive(sched, col, 5)
    assert [s for s, _ in trained] == [1, 2, 3, 4, 5] and col.pushes_during == 0
    assert col.started == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]   # (step, weights served when it started)
    sched.close()


@pytest.mark.parametrize("s", [1, 2, 3])
def test_staleness_is_bounded_by_max_staleness(s):
    """With rollout.max_staleness s the push is skipped while the next rollout stays within s steps; an eval
    or the last step forces it. Bugs caught: the bound off by one (staleness s + 1), pushes never skipped."""
    col = Rollouts(seconds=0.0)
    sched = OneStepOff(col, rc(s=s), 12, ParallelDims(), served=0)
    pushes = []
    real = sched.pushed
    sched.pushed = lambda step: (pushes.append(step), real(step))
    drive(sched, col, 12)
    stale = [(at - 1) - served for at, served in col.started]
    assert max(stale) == s and min(stale) == 0, stale
    assert pushes == sorted(set(range(s, 13, s)) | {12}), pushes     # every s-th step, and the last


def test_synchronous_is_the_collectors_own_loop():
    col = Rollouts(seconds=0.0)
    sched = make_schedule(col, rc(asynchronous=False), 3, ParallelDims(), served=0)
    assert isinstance(sched, Synchronous) and not isinstance(sched, OneStepOff)
    drive(sched, col, 3)
    assert col.started == [(1, 0), (2, 1), (3, 2)]   # each rollout on the weights of the step before


def test_a_checkpoint_holds_the_pending_rollout_and_a_resume_trains_it_first(tmp_path):
    """A save after step 2's push holds rollout 3 (finished at the boundary, not trained); a fresh schedule
    loaded from it (through torch.save and a weights_only load, as dcp.load_file reads it) trains it without
    running it again, then goes on. Every position is trained once across the crash. Bugs caught: the pending
    rollout lost (positions 30-39 never trained), run again (its prompts drawn twice), a state that needs
    pickled classes to load."""
    col = Rollouts()
    sched = OneStepOff(col, rc(), 5, ParallelDims(), served=0)
    before = drive(sched, col, 5, stop_after=2)
    torch.save(sched.state_dict(), tmp_path / "state.pt")
    sched.close()
    col2 = Rollouts()
    resumed = OneStepOff(col2, rc(), 5, ParallelDims(), served=2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True), step=2)
    after = drive(resumed, col2, 5, start=2)
    assert [a for a, _ in col2.started] == [4, 5]                  # rollout 3 came from the checkpoint
    groups = [g for _, gs in before + after for g in gs]
    assert sorted(groups) == list(range(10, 60)) and len(groups) == len(set(groups))
    with pytest.raises(ValueError, match="step 3's rollout, but the checkpoint is step 4's"):
        OneStepOff(Rollouts(), rc(), 5, ParallelDims(), served=4).load_state_dict(
            torch.load(tmp_path / "state.pt", weights_only=True), step=4)
    resumed.close()


# ---------------------------------------------------------------------------------------------- kill -9, e2e
ASYNC = ("--rollout.async", "true", "--grpo.use_tis", "true", "--steps", "5", "--train.save_every", "2")


def _train(out, *extra, kill_at=None):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", out, "--train.progress",
           "false", "--train.plots", "false", "--eval.every", "0", *extra]
    if kill_at is None:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = os.path.join(out, "metrics.jsonl"), time.time() + 240
    while proc.poll() is None and time.time() < deadline:     # step kill_at trained and logged, not yet saved
        if any(r["step"] == kill_at for r in read_jsonl(metrics, "train")):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _weights(out):
    cfg = parse_args(["--recipe", "smoke"])
    model = trainer.build_model(preset("tiny", **cfg.model), ParallelDims(), cfg.parallel, torch.float32, "cpu")
    load_checkpoint(latest_checkpoint(os.path.join(out, "checkpoints")), model, None, ParallelDims())
    return model.state_dict()


@pytest.mark.slow
def test_kill_9_and_resume_of_an_async_run_loses_no_sample_and_trains_none_twice(tmp_path):
    """The bar of issue 41: an asynchronous run killed with SIGKILL after step 3 (trained and logged; its last
    checkpoint is step 2's, with step 3's rollout pending in it and step 4's running), then resumed, trains the
    same groups at every step as the run that was never killed, each data position at most once, and ends on
    the same weights bit for bit. Bugs caught: the pending rollout not saved (its groups lost: the resumed
    step 3 trains other prompts), saved but the data position rewound (trained twice), the carried groups of
    partial rollouts lost (second run)."""
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    _train(full, *ASYNC)
    _train(split, *ASYNC, kill_at=3)
    ckpts = sorted(os.listdir(os.path.join(split, "checkpoints")))
    assert ckpts[-1] == "step_00000002", ckpts                    # killed between two saves
    out = _train(split, *ASYNC)
    assert "resumed from" in out and "step 2" in out
    a = read_jsonl(os.path.join(full, "metrics.jsonl"), "train")
    b = read_jsonl(os.path.join(split, "metrics.jsonl"), "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["trained_groups"] for r in a] == [r["trained_groups"] for r in b]
    groups = [g for r in b for g in r["trained_groups"]]
    assert len(groups) == len(set(groups)), groups
    assert [r["staleness_max"] for r in b] == [0, 1, 1, 1, 1]
    wa, wb = _weights(full), _weights(split)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_kill_9_and_resume_with_partial_rollouts_keeps_the_pending_batch_and_trains_no_group_twice(tmp_path):
    """One step off with partial rollouts (rollout.max_staleness 3), killed after step 3 and resumed: step 3 is
    the batch the checkpoint held (the same groups the killed run trained), and no data position is trained
    twice across the crash, carried groups included. Bug caught: the carried groups left out of the checkpoint
    (a resumed run draws fresh prompts where the killed one continued them), the pending batch rebuilt."""
    split = str(tmp_path / "split")
    extra = (*ASYNC, "--rollout.partial", "true", "--rollout.max_staleness", "3", "--rollout.max_new_tokens", "6")
    _train(split, *extra, kill_at=3)
    killed = {r["step"]: r for r in read_jsonl(os.path.join(split, "metrics.jsonl"), "train")}
    state = torch.load(os.path.join(split, "checkpoints", "step_00000002", "rank0_rollout_state.pt"), weights_only=True)
    oldest = [min((v for smp in g["samples"] for v, k, _ in smp["segments"] if k), default=None)
              for g in state["collector"]["carry"]["groups"]]
    carried = [o for o in oldest if o is None or (4 - 1) - o <= 3]    # what rollout 4 may continue
    out = _train(split, *extra)
    b = read_jsonl(os.path.join(split, "metrics.jsonl"), "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5] and b[2]["trained_groups"] == killed[3]["trained_groups"]
    groups = [g for r in b for g in r["trained_groups"]]
    assert len(groups) == len(set(groups)), groups
    assert max(r["staleness_max"] for r in b) <= 3 and sum(r["partial_samples"] for r in b) > 0
    assert carried, "the checkpoint holds no carried group: the carry was not saved (or the tail left none)"
    line = next(ln for ln in out.splitlines() if ln.startswith("rollout 4/5 round 1:"))
    assert f"{len(carried)} carried" in line, (oldest, line)    # continued by the resumed run


def test_a_server_restart_met_by_the_rollout_beside_a_step_is_redone_after_the_re_push():
    """Rollout 3 (running beside step 2) meets a restarted server: the boundary says so (the loop re-connects
    and re-pushes), rollout 3's failed result is dropped, and step 3 takes a rollout 3 run again, on the weights
    pushed then. Bugs caught: the failed rollout taken as step 3's batch (None: a step without data), the
    restart not reported (no re-push into the fresh server), the redo started before the re-push."""
    col = Rollouts(seconds=0.0)
    real, failed = col.next_batch, []

    def next_batch(at):
        if at == 3 and not failed:
            failed.append(at)
            col.started.append((at, col.served))
            raise ServerGoneError("http://r0:30000 is gone")
        return real(at)
    col.next_batch = next_batch
    sched = OneStepOff(col, rc(), 4, ParallelDims(), served=0)
    for step in (1, 2):
        sched.take(step)
        err = sched.boundary()   # the error's text on every rank ("" if none): the loop's restart policy takes it
        assert bool(err) == (step == 2) and ("ServerGoneError" in err or not err), err
        sched.pushed(step)
    batch, m = sched.take(3)
    assert int(batch.input_ids[0, 0]) == 3
    assert col.started[:4] == [(1, 0), (2, 0), (3, 1), (3, 2)]      # redone on the weights pushed after the restart
    sched.close()

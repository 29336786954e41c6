"""The loop's one extension point (`nanoflash/rl/hooks.py`): hooks named on the command line, called by the loop
at its points, never by name.

Bugs these catch: a hook point the loop stops calling (or calls after the update, when the old log-probs no
longer match the weights: the live check's FP8 floor would be measured against the wrong policy), a hook's
metrics not logged, a misspelled hook that fails after the model was built instead of as one line at start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nanoflash.rl.hooks import Hook, HookContext, Hooks, load_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_load_hook_names_the_culprit():
    assert load_hook("tests.hook_recorder:Recorder").name == "recorder"
    with pytest.raises(ValueError, match="module:Class"):
        load_hook("tests.hook_recorder")
    with pytest.raises(ValueError, match="not a nanoflash.rl.hooks.Hook"):
        load_hook("json:JSONDecoder")


def test_hooks_merge_metrics_and_name_eval_records():
    class A(Hook):
        name = "a"

        def after_push(self, version):
            return {"x": version, "y": 1}

        def after_eval(self, at, acc, gen_for):
            return {"acc": acc}

    class B(Hook):
        def after_push(self, version):
            return {"y": 2}
    hooks = Hooks([], None)
    ctx = HookContext(None, None, None, None, None, None)
    hooks.hooks = [A(ctx), B(ctx)]
    assert hooks.after_push(3) == {"x": 3, "y": 2}           # a later hook wins a key
    assert hooks.after_eval(5, 0.5, None) == {"eval_a": {"acc": 0.5}}   # B returned nothing: no record


def test_train_py_calls_every_hook_point_in_order(tmp_path):
    """The smoke run with the recorder: a push record at start, then per step before_update (the weights
    before the update) then after_push, after_eval at each eval point, close at the end; metrics logged."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", out, "--train.steps", "2",
           "--eval.every", "2", "--train.save_every", "0", "--train.progress", "false", "--train.plots", "false",
           "--train.hooks", "tests.hook_recorder:Recorder"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    calls = [json.loads(line) for line in open(os.path.join(out, "hook_calls.jsonl"))]
    kinds = [c["call"] for c in calls]
    assert kinds[0] == "after_push" and calls[0]["version"] == 0, kinds
    assert kinds[-1] == "close", kinds
    steps = [c for c in calls if c["call"] == "before_update"]
    assert [c["step"] for c in steps] == [1, 2], kinds
    for c in steps:   # each before_update sees the weights of the previous push, then the step's push follows
        i = calls.index(c)
        prev, nxt = [p for p in calls[:i] if p["call"] == "after_push"][-1], calls[i + 1]
        assert prev["call"] == "after_push" and prev["version"] == c["step"] - 1, calls[i - 1:i + 2]
        assert c["weights_sum"] == prev["weights_sum"], "before_update ran after the update"
        assert nxt["call"] == "after_push" and nxt["version"] == c["step"], calls[i:i + 2]
        assert nxt["weights_sum"] != c["weights_sum"], "the step's push carries the updated weights"
    assert [c["at"] for c in calls if c["call"] == "after_eval"] == [0, 2]   # eval.before_train, then step 2
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in recs if r.get("kind") == "train" or r.get("event") == "train"]
    text = open(os.path.join(out, "metrics.jsonl")).read()
    assert "recorder_gap" in text and "recorder_push" in text and "eval_recorder" in text, train[:1]


def test_a_hook_that_cannot_be_imported_is_one_line(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", str(tmp_path / "r"),
           "--train.hooks", "no_such_module_xyz:Hook"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "no_such_module_xyz" in p.stderr

"""The loop's one extension point (`nanoflash/rl/hooks.py`): hooks named on the command line, called by the loop
at its points, never by name.

Bugs these catch: a hook point the loop stops calling (or calls after the update, when the old log-probs no
longer match the weights: the live check's FP8 floor would be measured against the wrong policy), a hook's
metrics not logged, a misspelled hook that fails after the model was built instead of as one line at start.
The loop's calls in order, on a real run: tests/test_train_e2e.py::test_hook_points_in_order (its smoke run
carries tests/hook_recorder.py).
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


def test_a_hook_that_cannot_be_imported_is_one_line(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--out", str(tmp_path / "r"),
           "--train.hooks", "no_such_module_xyz:Hook"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "no_such_module_xyz" in p.stderr

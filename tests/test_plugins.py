"""Reward plug-ins (`--train.reward module:function`, nanoflash/rl/plugins.py): loaded from a module in a temporary
directory, run in worker processes; the contract's outcomes (value, timeout, exception, non-number) each
checked, and one short train.py run that trains on a plug-in reward.

Run: `pytest tests/test_plugins.py -q`.
"""
import os
import signal
import subprocess
import sys

import pytest

from nanoflash import cli
from nanoflash.rl import collector, plugins
from nanoflash.rl.data import Problem
from nanoflash.rl.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 1.0  # the plug-in's "hang" sleeps 30 s: far past this, so the timeout path is the only way out
PLUGIN = '''
import time

def score(response, problem):
    """1 for the reference answer, 0.5 for any other single digit, 0 otherwise."""
    if response == "hang":
        time.sleep(30)
    if response == "boom":
        raise ValueError("cannot score " + response)
    if response == "nan":
        return float("nan")
    if response.strip() == problem.answer:
        return 1.0
    return 0.5 if len(response) == 1 and response.isdigit() else 0.0

def even(response, problem):
    return response.isdigit() and int(response) % 2 == 0

def one_arg(response):
    return 0.0

def numpy_or_fork(response, problem):
    import numpy as np, os, subprocess, time
    if response == "np":
        return np.float32(0.5)
    child = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(os.path.dirname(__file__), "child.pid"), "w") as f:
        f.write(str(child.pid))
    time.sleep(30)
'''


@pytest.fixture()
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_values_bools_and_timeouts(plugin_dir, capsys):
    p = Problem("t-0", "0527+1=", "8")
    reward = plugins.PluginReward("my_rewards:score", n_workers=2, timeout_s=TIMEOUT_S)
    try:
        assert reward(["8", "3", "x8", "hang"], [p] * 4) == [1.0, 0.5, 0.0, 0.0]
        assert reward.counts["ok"] == 3 and reward.counts["timeout"] == 1
        assert "1 of 4 calls timed out" in capsys.readouterr().err
    finally:
        reward.close()
    even = plugins.PluginReward("my_rewards:even", n_workers=1, timeout_s=TIMEOUT_S)
    try:
        assert even(["4", "7", "x"], [p] * 3) == [1.0, 0.0, 0.0]        # bools count as 0 / 1
    finally:
        even.close()


@pytest.mark.parametrize("response, says", [("boom", "ValueError: cannot score boom"), ("nan", "not a finite number")])
def test_plugin_exception_or_non_number_stops_with_one_line(plugin_dir, response, says):
    reward = plugins.PluginReward("my_rewards:score", n_workers=1, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(plugins.RewardPluginError) as exc:
            reward(["8", response], [Problem("t-7", "0527+1=", "8")] * 2)
    finally:
        reward.close()
    assert isinstance(exc.value, SystemExit) and "my_rewards:score" in str(exc.value) and "'t-7'" in str(exc.value)
    assert says in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("spec, says", [("my_rewards", "module:function"), ("my_rewards:nope", "no function 'nope'"),
                                        ("my_rewards:one_arg", "one_arg(response) cannot be called"),
                                        ("missing_mod_q:score", "cannot import 'missing_mod_q'")])
def test_plugin_load_errors_name_the_spec(plugin_dir, spec, says):
    with pytest.raises(ValueError, match="train.reward=") as exc:
        plugins.load_plugin(spec)
    assert says in str(exc.value)


def test_make_task_uses_the_plugin_for_token_responses(plugin_dir):
    cfg = cli.parse_args(["--recipe", "smoke", "--train.reward", "my_rewards:score"])
    task = collector.make_task(cfg.train, cfg.eval, 18)
    prob = task.train[0]
    right = task.encode(Problem("x", prob.prompt + prob.answer, prob.answer))[len(task.encode(prob)):]
    other = str((int(prob.answer) + 1) % 10)
    wrong = task.encode(Problem("x", prob.prompt + other, other))[len(task.encode(prob)):]
    eos = task.stop_ids[0]
    assert task.reward([prob, prob], [right + [eos], wrong + [eos]]) == [1.0, 0.5]


LOGGING_PLUGIN = PLUGIN + '''

def logged(response, problem):
    import os
    with open(os.path.join(os.path.dirname(__file__), "calls.log"), "a") as f:
        f.write(problem.id + "\\n")
    return score(response, problem)
'''


def test_train_py_trains_on_a_plugin_from_the_working_directory(tmp_path):
    """The module sits in the directory train.py is started from (not on PYTHONPATH): rollouts and evals call it."""
    (tmp_path / "my_rewards.py").write_text(LOGGING_PLUGIN)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--steps", "1",
                        "--train.reward", "my_rewards:logged", "--out", str(out), "--train.progress", "false",
                        "--train.plots", "false"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    calls = (tmp_path / "calls.log").read_text().split()
    train = read_jsonl(str(out / "metrics.jsonl"), "train")
    assert len(train) == 1 and sum(c.startswith("arith-train-") for c in calls) == train[0]["n_episodes"]
    n_eval = len(read_jsonl(str(out / "metrics.jsonl"), "eval"))   # steps 0 and 1: 16 problems x 2 samples each
    assert sum(c.startswith("arith-heldout-") for c in calls) == n_eval * 16 * 2


def _children() -> list[int]:
    """Pids of this process's live child processes (read from /proc: the reward workers are Popen children)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(pid))
    return out


def test_reward_workers_start_only_on_the_rank_that_scores(plugin_dir, tmp_path, monkeypatch):
    """Bug: every rank of a multi-rank run started the reward pool (math-verify or a plug-in's workers) at start-up,
    although only rank 0 ever scores: 16 ranks x 2 idle interpreters on the training nodes. Start-up on rank 1 now
    starts none; rank 0 starts them at once (so a verifier that cannot start still fails at start-up there)."""
    argv = ["--recipe", "smoke", "--train.reward", "my_rewards:score", "--out", str(tmp_path / "run")]
    before = set(_children())
    monkeypatch.setenv("RANK", "1")
    task = cli.startup(argv)[2]
    assert set(_children()) == before, "rank 1 started reward workers"
    prob = task.train[0]
    right = task.encode(Problem("x", prob.prompt + prob.answer, prob.answer))[len(task.encode(prob)):]
    assert task.reward([prob], [right + [task.stop_ids[0]]]) == [1.0]   # still scores if asked (started then)
    monkeypatch.setenv("RANK", "0")
    started = set(_children())
    cli.startup(argv + ["--train.resume", "true"])
    new = set(_children()) - started
    for pid in set(_children()) - before:   # the workers this test started (they would exit with the test process)
        os.kill(pid, signal.SIGKILL)
    assert len(new) == 2, "rank 0 starts train.reward_workers (2) workers at start-up"


def test_numpy_values_forked_children_and_a_hanging_import(plugin_dir):
    """Issue 39 (low). Bugs caught: a plug-in returning np.float32 stopped the run ("not a finite number"); a
    plug-in's forked children outlived the worker killed for its timeout; a plug-in that hangs at import hung
    start-up (now: one ValueError after the import timeout, the check's process group killed)."""
    import time
    p = Problem("t-0", "0527+1=", "8")
    reward = plugins.PluginReward("my_rewards:numpy_or_fork", n_workers=1, timeout_s=TIMEOUT_S)
    try:
        assert reward(["np", "fork"], [p, p]) == [0.5, 0.0] and reward.counts["timeout"] == 1
    finally:
        reward.close()
    child = int((plugin_dir / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:   # killed; reaped by init
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or "zombie" in open(f"/proc/{child}/status").read().lower()
    (plugin_dir / "slow_import.py").write_text("import time\ntime.sleep(60)\ndef score(r, p):\n    return 0.0\n")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"importing 'slow_import' did not finish in 1 s"):
        plugins.PluginReward("slow_import:score", n_workers=1, timeout_s=TIMEOUT_S, import_timeout_s=1.0)
    assert time.monotonic() - t0 < 30

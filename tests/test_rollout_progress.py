"""Rollout progress (issue 40, "silence"): one line per dynamic-sampling round -- prompts sent, groups kept, the
share of all-equal-reward groups -- and, when a round keeps nothing, a warning naming the cause.

The bug each test catches: a rollout whose rounds keep no group printed nothing at all (the bar sat at 0/G, or
with `--train.progress false` the terminal stayed silent) until `rollout.max_rounds` ran out, and then only
"kept 0/N groups"; the user could not tell that every group's rewards were equal (all 0: the model never
answers), which is what dynamic sampling drops.

Run: `pytest tests/test_rollout_progress.py -q`.
"""
import os
import subprocess
import sys

from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.rl import collector
from nanoflash.rl.collector import RoundStats, round_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = parse_args(["--recipe", "demo"])          # rollout.max_new_tokens=2, dynamic sampling on


def test_round_line_counts_and_causes():
    kept = RoundStats(1, 16, 16, 8, 8, 16, {0.0: 5, 1.0: 3}, truncated=2, samples=128, seconds=3.21)
    assert round_line(kept, "rollout 2/60", CFG) == ("rollout 2/60 round 1: 16 prompts sent, 8 of 16 groups kept "
                                                     "(8/16 so far), 50% all-equal (5 all 0, 3 all 1) (3.2s)")
    never = RoundStats(3, 32, 32, 0, 0, 32, {0.0: 32}, truncated=250, samples=256)
    assert round_line(never, "rollout 1/60", CFG) == (
        "warning: rollout 1/60 round 3: 0 of 32 groups kept: every group's rewards were equal (all 0: the model "
        "never answers correctly; 98% of the responses were cut at rollout.max_new_tokens=2) -- dynamic sampling "
        "drops them; see grpo.dynamic_sampling")
    easy = RoundStats(1, 4, 4, 0, 0, 4, {1.0: 4}, samples=32)
    assert "(all 1: the model always answers correctly: the prompts are too easy for it)" in round_line(easy, "r", CFG)
    mixed = RoundStats(1, 4, 4, 0, 0, 4, {0.0: 3, 1.0: 1}, samples=32)
    assert "every group's rewards were equal (3 all 0, 1 all 1) -- dynamic sampling" in round_line(mixed, "r", CFG)
    lost = RoundStats(1, 4, 0, 0, 0, 4, {}, too_long=4)
    assert "no group came back (4 prompts over the servers' context length" in round_line(lost, "r", CFG)
    off = parse_args(["--recipe", "demo", "--grpo.dynamic_sampling", "false"])
    assert round_line(RoundStats(1, 4, 4, 4, 4, 4, {0.0: 4}), "r", off).startswith("r round 1: 4 prompts sent, 4 of")


def test_collect_reports_every_round_and_its_numbers_add_up():
    """The embedded server, a random tiny model, rewards of the task: each round's line matches what collect
    returns (rounds, kept and seen groups), and a reward that is always 0 turns every round into the warning."""
    cfg = parse_args(["--recipe", "smoke", "--rollout.max_rounds", "3"])
    mcfg = preset("tiny", **cfg.model)
    client, engines, httpds = collector.start_embedded(Transformer(mcfg).init_weights(0), 1, "fp32", 0)
    try:
        task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
        rounds = []
        kept, seen, _, counts = collector.collect(client, task, 0, cfg, mcfg, on_round=rounds.append)
        assert len(rounds) == counts["rounds"] and [r.round for r in rounds] == list(range(1, len(rounds) + 1))
        assert sum(r.answered for r in rounds) == counts["groups_seen"] == len(seen) // cfg.grpo.group_size
        assert min(sum(r.kept for r in rounds), cfg.grpo.n_prompts) == counts["groups_kept"]
        assert all(r.answered - r.kept == sum(r.equal.values()) for r in rounds)
        task.reward = lambda problems, ids: [0.0] * len(ids)
        rounds.clear()
        kept, _, _, counts = collector.collect(client, task, 0, cfg, mcfg, on_round=rounds.append)
        lines = [round_line(r, "rollout 1/3", cfg) for r in rounds]
        assert not kept and len(lines) == 3 == counts["rounds"]
        assert all(ln.startswith(f"warning: rollout 1/3 round {i + 1}: 0 of 4 groups kept: every group's rewards "
                                 f"were equal (all 0: the model never answers correctly") for i, ln in enumerate(lines))
    finally:
        httpds[0].shutdown()


def test_train_py_says_why_no_group_is_kept(tmp_path):
    """What a user sees: train.py with a reward that never pays prints the warning every round, before the step."""
    (tmp_path / "zero_reward.py").write_text("def score(response, problem):\n    return 0.0\n")
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--recipe", "smoke", "--train.warmup_steps",
                        "0", "--steps", "1", "--train.reward", "zero_reward:score", "--eval.every", "0",
                        "--train.plots", "false", "--train.progress", "false", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    warn = [i for i, ln in enumerate(lines) if ln.startswith("warning: rollout 1/1 round ")]
    assert len(warn) == 2, p.stdout                                  # smoke: rollout.max_rounds=2
    assert all("0 of 4 groups kept: every group's rewards were equal (all 0: the model never answers correctly"
               in lines[i] and "see grpo.dynamic_sampling" in lines[i] for i in warn), p.stdout
    step = next(i for i, ln in enumerate(lines) if ln.startswith("step 1:"))
    assert warn[-1] < step and "kept 0/8 groups" in lines[step]

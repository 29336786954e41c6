"""Data and model output that must never crash a run (issue 16): each fault handled, and counted where it is
skipped. Over-long prompts (the server's 400), integers past int()'s 4,300 digits (in the data and in the
model's output), token ids outside the task's tokenizer, a data file with no rows, a verifier that cannot
start, and the reward counters the rollout logs. Loopback only. Run: `pytest tests/test_data_faults.py -q`.
"""
from __future__ import annotations

import pytest

from nanoflash.rl import collector, data, rewards
from nanoflash.config import GRPOConfig, RolloutConfig, RunConfig, TrainConfig, preset
from nanoflash.rl.data import CharTokenizer, Problem
from nanoflash.model import Transformer
from nanoflash.sglang.client import RequestRejected
from nanoflash.cli import startup

HUGE = "9" * 4999 + "7"   # 5,000 digits: int(HUGE) raises ValueError (sys.int_info.default_max_str_digits = 4300)


class NoPool:
    """A VerifierPool stand-in: the integer path must decide without it; other items 'error' (counted)."""

    def map(self, fn, args):
        return [("error", "boom")] * len(args)


def test_over_long_prompts_are_skipped_and_counted_and_oov_responses_score_zero():
    """Bug caught: the server's 400 for a prompt over max_seq_len ended the run (RequestRejected), and a
    sampled id outside the task tokenizer crashed the reward (`python train.py`'s default config)."""
    model = Transformer(preset("tiny")).init_weights(0)
    client, engines, httpds = collector.start_embedded(model, 1, "fp32", seed=0)
    try:
        long, short = Problem("long", str(model.cfg.max_seq_len + 1), "1"), Problem("short", "4", "1")
        vocab = 1  # the task's tokenizer knows only id 0: the model's other 255 ids are out of its vocabulary
        reward = rewards.token_reward_fn(lambda ids: "x" * len(ids), rewards.arith_reward, vocab_size=vocab)
        task = collector.Task([long, short], [], lambda p: [5] * int(p.prompt), None, reward, [], 0)
        gc = GRPOConfig(n_prompts=2, group_size=2, over_sampling_batch_size=2, dynamic_sampling=False)
        rc = RolloutConfig(max_new_tokens=1, max_rounds=1, max_workers=2)
        cfg = RunConfig(train=TrainConfig(seed=1), grpo=gc, rollout=rc)
        kept, seen, pos, counts = collector.collect(client, task, 0, cfg, model.cfg)
        assert pos == 2 and counts["prompts_too_long"] == 1 and len(seen) == 2  # the short prompt's group
        oov = sum(any(t >= vocab for t in e.response_ids) for e in seen)
        assert counts["reward_oov"] == oov and all(e.reward == 0.0 for e in seen
                                                    if any(t >= vocab for t in e.response_ids))
    finally:
        httpds[0].shutdown()
    sglang = RequestRejected("u", 400, "The input (300 tokens) is longer than the model's context length (256 tokens).")
    assert sglang.too_long and not RequestRejected("u", 400, "sampling_params.n=0 is invalid").too_long
    assert CharTokenizer().decode([100, 3]) == "\ufffd0"  # an unknown id decodes (to U+FFFD), never raises


def test_integers_past_int_digit_limit_compare_exactly(tmp_path):
    """Bug caught: `int()` on a 5,000-digit answer (in the data or the model's output) raised ValueError."""
    with pytest.raises(ValueError):
        int(HUGE)
    assert rewards.integer_match("+000" + HUGE, HUGE) and rewards.integer_match("-0", "0")
    assert not rewards.integer_match(HUGE[:-1] + "8", HUGE) and not rewards.integer_match("-" + HUGE, HUGE)
    path = tmp_path / "huge.jsonl"
    path.write_text(f'{{"problem": "p", "answer": {HUGE}}}\n')  # a JSON number, not a string
    (problem,), skipped = data.load_problems(str(path))
    assert problem.answer == HUGE and skipped == 0  # a JSON integer of any length, read exactly
    math = rewards.MathReward(pool=NoPool())
    assert math([f"so \\boxed{{{HUGE}}}", "Answer: 12"], [HUGE, HUGE]) == [1.0, 0.0]
    assert rewards.arith_reward([HUGE], [HUGE]) == [1.0]


def test_a_data_file_without_rows_is_a_start_up_error_naming_it(tmp_path, capsys):
    """Bug caught: an empty file loaded as 0 problems, then `pos % len(train)` raised ZeroDivisionError."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the data file has no rows"):
        data.load_problems(str(empty))
    with pytest.raises(SystemExit) as e:
        startup(["--preset", "small", "--train.task", "chat", "--train.data", str(empty), "--eval.every", "0",
                 "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "empty.jsonl: the data file has no rows" in capsys.readouterr().err


def test_a_verifier_that_cannot_start_is_an_error_and_its_counts_are_kept(tmp_path, monkeypatch):
    """Bug caught: workers that die on import scored everything 0, and the counts were never logged."""
    with pytest.raises(ImportError, match="no_such_verifier_pkg"):
        rewards.VerifierPool(n_workers=1, warm_imports=("no_such_verifier_pkg",))
    (tmp_path / "broken_verifier.py").write_text("raise RuntimeError('cannot load the grader')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers' PYTHONPATH is this process's sys.path
    with rewards.VerifierPool(n_workers=1, timeout_s=30, warm_imports=("broken_verifier",)) as pool:
        with pytest.raises(rewards.VerifierUnavailable, match="cannot load the grader"):
            pool.map(len, [("ab",)])
    token = rewards.token_reward_fn(lambda ids: "Answer: x/2", rewards.MathReward(pool=NoPool()), vocab_size=8)
    assert token([Problem("a", "p", "1/2")] * 2, [[1, 2], [9]]) == [0.0, 0.0]
    assert token.counts == {"verify_error": 1, "oov": 1}  # what collect logs as reward_verify_error, reward_oov


def test_a_bom_and_a_non_utf8_line_cost_one_row_each_named(tmp_path, capsys):
    """Issue 39 (low). Bugs caught: a UTF-8 byte-order mark made the first row unparseable (skipped silently);
    one invalid UTF-8 byte failed the whole file (UnicodeDecodeError) without naming the file or the line."""
    rows = [b'{"prompt": "1+1", "answer": "2"}', b'{"prompt": "caf\xe9", "answer": "3"}',
            b'{"prompt": "2+2", "answer": "4"}']
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(rows) + b"\n")
    problems, skipped = data.load_problems(str(path), "t")
    assert [p.answer for p in problems] == ["2", "4"] and skipped == 1
    assert f"{path}:2: not UTF-8" in capsys.readouterr().err

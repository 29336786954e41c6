"""Tests of nanoflash/rl/rewards.py: answer extraction, math-verify equivalence in a process pool, timeouts.

Run: pytest tests/test_rewards.py -q
"""
import os
import subprocess
import sys
import time

import pytest

from nanoflash.rl.data import CharTokenizer, Problem
from nanoflash.rl.rewards import (MathReward, VerifierPool, answer_line, arith_reward, extract_answer, integer_match,
                               last_boxed, token_reward_fn)

HANG_TIMEOUT_S = 1.0  # per-item limit in the timeout tests: long enough for a no-op item on a loaded 2-core box


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{42}", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{2}", "2"),                                 # last one wins
    (r"\boxed{7} and a broken \boxed{\frac{1}{2}", "7"),                # unclosed last box: previous complete one
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                                  # escaped braces do not count
    (r"\fbox{3}", "3"),
    (r"\boxed 5$", "5"),
    (r"\boxed{ {a}^{2} }", "{a}^{2}"),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    got = last_boxed(text)
    assert (got[0] if got else None) == expected


@pytest.mark.parametrize("text,expected", [
    ("work\nAnswer: 34", "34"),
    ("**Answer:** $34$.", "34"),
    ("Answer: \\boxed{34}", "34"),
    ("answer: -7\nmore text", "-7"),
    ("Answer: 1\nAnswer: 2", "2"),
    ("Answer:   \nAnswer: 9", "9"),
    ("Answer：12", "12"),                                                 # full-width colon
    ("The answer is 5", None),
])
def test_answer_line(text, expected):
    got = answer_line(text)
    assert (got[0] if got else None) == expected


@pytest.mark.parametrize("text,expected", [
    ("I think \\boxed{1}</think>The result is \\boxed{2}.", "2"),       # only text after </think>
    ("\\boxed{1}</think>Answer: 3", "3"),
    ("Answer: 3\nso finally \\boxed{4}", "4"),                           # the later of the two
    ("\\boxed{4}\nAnswer: 5", "5"),
    ("reasoning truncated \\boxed{6} without closing think", "6"),     # no </think>: whole text, like Miles
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("pred,gold,expected", [
    ("42", "42", True), ("+42", "42", True), ("042", "42", True), ("-3", "-3", True), ("1,000", "1000", True),
    ("42.0", "42", False), ("41", "42", False), (None, "42", False), ("x", "42", False),
    ("22099999999999998951425", "22099999999999998951424", False),      # big ints compared exactly
])
def test_integer_match(pred, gold, expected):
    assert integer_match(pred, gold) is expected


@pytest.fixture(scope="module")
def math_reward():
    reward = MathReward(n_workers=2)
    yield reward
    reward.close()


def test_math_reward_equivalences(math_reward):
    cases = [  # (response, gold, expected reward)
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"Answer: $\frac{1}{2}$", "0.5", 1.0),
        (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
        (r"\boxed{204.0}", "204", 1.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        ("Answer: 204", "204", 1.0),
        ("Answer: 205", "204", 0.0),
        ("no answer at all", "204", 0.0),
    ]
    rewards = math_reward([c[0] for c in cases], [c[1] for c in cases])
    assert rewards == [c[2] for c in cases]
    assert math_reward.counts["integer"] == 2 and math_reward.counts["no_answer"] == 1
    assert math_reward.counts["verify_ok"] == 6


def test_pool_timeout_kills_worker_and_continues():
    with VerifierPool(n_workers=2, timeout_s=HANG_TIMEOUT_S, warm_imports=()) as pool:
        first_pids = [w[0].pid for w in pool._workers]
        out = pool.map(time.sleep, [(0,), (3600,), (0,), (0,)])
        assert [s for s, _ in out] == ["ok", "timeout", "ok", "ok"]
        assert pool.counts["timeout"] == 1
        assert sorted(w[0].pid for w in pool._workers) != sorted(first_pids)  # the hung worker was replaced
        assert [s for s, _ in pool.map(abs, [(-2,), (3,)])] == ["ok", "ok"]  # and the pool still works


def test_pool_crash_and_error_score_zero():
    with VerifierPool(n_workers=1, timeout_s=30.0, warm_imports=()) as pool:
        out = pool.map(os._exit, [(3,)])
        assert out == [("crash", None)]
        out = pool.map(int, [("x",), ("12",)])
        assert out[0][0] == "error" and "ValueError" in out[0][1] and out[1] == ("ok", 12)
        assert pool.counts["crash"] == 1 and pool.counts["error"] == 1


def _hanging_verify(pred, gold):  # runs in a worker process (imported there by name)
    time.sleep(3600)


def test_math_reward_scores_zero_when_verify_hangs():
    with VerifierPool(n_workers=1, timeout_s=HANG_TIMEOUT_S, warm_imports=()) as pool:
        reward = MathReward(pool=pool, verify_fn=_hanging_verify)
        assert reward([r"\boxed{\frac{1}{2}}", "Answer: 3"], ["0.5", "3"]) == [0.0, 1.0]
        assert reward.counts["verify_timeout"] == 1 and reward.counts["integer"] == 1


def test_arith_reward_and_token_adapter():
    tok = CharTokenizer()
    problems = [Problem("a", "2+3=", "5"), Problem("b", "2-3=", "-1"), Problem("c", "4*4=", "16")]
    responses = [tok.encode("5") + [tok.eos_id], tok.encode(" -1") + [tok.eos_id, 5], tok.encode("15")]
    assert token_reward_fn(tok.decode, arith_reward)(problems, responses) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        arith_reward(["1", "2"], ["1"])


def test_pool_works_from_a_main_that_cannot_be_reimported():
    """spawn-based pools crash when `__main__` is stdin (or re-run an unguarded script); ours must not."""
    script = ("from nanoflash.rl.rewards import VerifierPool\n"
              "with VerifierPool(n_workers=1, warm_imports=()) as pool:\n"
              "    print(pool.map(abs, [(-3,)]))\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[('ok', 3)]", done.stderr[-2000:]

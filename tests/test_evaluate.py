"""Tests of nanoflash/rl/evaluate.py: pass@k against brute-force enumeration, evaluate() on a scripted generator.

Run: pytest tests/test_evaluate.py -q
"""
import itertools
import math
from fractions import Fraction

import pytest

from nanoflash.rl.data import CharTokenizer, arithmetic_problems
from nanoflash.rl.evaluate import evaluate, pass_at_k
from nanoflash.rl.rewards import arith_reward, token_reward_fn

EXACT_TOL = 1e-12  # pass_at_k is a product of <= n float factors; a few ulps of rounding, nothing more


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that contain at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert abs(pass_at_k(n, c, k) - _brute_pass_at_k(n, c, k)) < EXACT_TOL, (n, c, k)


def test_pass_at_k_large_n_is_stable():
    for n, c, k in [(1000, 10, 500), (5000, 1, 4999), (2000, 1999, 1), (3000, 0, 7)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert abs(pass_at_k(n, c, k) - float(exact)) < EXACT_TOL, (n, c, k)
    assert pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 0, 8) == 0.0
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)


def _scripted_generator(tok, plan):
    """generate_fn whose sample j of prompt i is right iff plan[i][j] == 'R'; 'T' = wrong and cut at the limit."""
    def generate_fn(prompt_ids, n):
        out = []
        for i, ids in enumerate(prompt_ids):
            truth = str(eval(tok.decode(ids)[:-1]))  # the arithmetic expression, evaluated naively
            group = []
            for mark in plan[i][:n]:
                if mark == "R":
                    group.append((tok.encode(truth) + [tok.eos_id], "stop"))
                elif mark == "W":
                    group.append((tok.encode(truth + "1") + [tok.eos_id], "stop"))
                else:
                    group.append((tok.encode("9" * 6), "length"))
            out.append(group)
        return out
    return generate_fn


def test_evaluate_on_scripted_samples():
    tok = CharTokenizer()
    problems = arithmetic_problems(3, "heldout", difficulty=2, seed=0)
    plan = ["RRRR", "RWWT", "WWWW"]  # c = 4, 1, 0
    res = evaluate(problems, _scripted_generator(tok, plan), k_samples=4,
                   reward_fn=token_reward_fn(tok.decode, arith_reward), max_new_tokens=6, encode_fn=tok.encode_prompt)
    assert res["per_problem_correct"] == [4, 1, 0]
    assert res["accuracy"] == pytest.approx(5 / 12)
    assert res["pass@1"] == pytest.approx((1 + 1 / 4 + 0) / 3)
    assert res["pass@2"] == pytest.approx((1 + 1 / 2 + 0) / 3)  # 1 - C(3,2)/C(4,2) = 1/2
    assert res["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert "pass@8" not in res  # k > n is not reported
    assert res["truncation_rate"] == pytest.approx(1 / 12)
    assert (res["n_problems"], res["n_samples"]) == (3, 12)
    # standard errors over the 3 problems, by hand: per-problem pass@1 = 1, 1/4, 0 (mean 5/12); pass@2 = 1, 1/2, 0
    se1 = math.sqrt(((1 - 5 / 12) ** 2 + (1 / 4 - 5 / 12) ** 2 + (5 / 12) ** 2) / 2 / 3)
    se2 = math.sqrt(((1 - 1 / 2) ** 2 + 0 + (1 / 2) ** 2) / 2 / 3)
    assert (res["pass@1_se"], res["pass@2_se"]) == (pytest.approx(se1), pytest.approx(se2))
    assert res["pass@4_se"] == pytest.approx(math.sqrt(((1 - 2 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2 / 3))


def test_evaluate_rejects_malformed_generator_output():
    tok = CharTokenizer()
    problems = arithmetic_problems(2, "train", difficulty=1, seed=0)
    reward_fn = token_reward_fn(tok.decode, arith_reward)
    short = lambda prompts, n: [[([3], "stop")] * (n - 1) for _ in prompts]
    with pytest.raises(ValueError, match="3 samples for prompt 0, expected n=4"):
        evaluate(problems, short, 4, reward_fn, 8, tok.encode_prompt)
    too_long = lambda prompts, n: [[([3] * 9, "stop")] * n for _ in prompts]
    with pytest.raises(ValueError, match="9 tokens > max_new_tokens=8"):
        evaluate(problems, too_long, 4, reward_fn, 8, tok.encode_prompt)


def test_answers_ending_with_the_stop_token_at_the_limit_are_not_truncated():
    """Issue 18: the demo's "8" + <eos> fills max_new_tokens=2 exactly and is complete; only a response cut
    before its stop token ("length") is truncated."""
    tok = CharTokenizer()
    problems = arithmetic_problems(4, "heldout", difficulty=4, seed=0, answer="mod10")

    def generate_fn(prompt_ids, n):   # per problem: right + <eos>, wrong + <eos>, and one cut at the limit
        return [[(tok.encode(p.answer) + [tok.eos_id], "stop"), (tok.encode("0") + [tok.eos_id], "stop"),
                 (tok.encode("12"), "length")][:n] for p in problems]
    res = evaluate(problems, generate_fn, k_samples=3, reward_fn=token_reward_fn(tok.decode, arith_reward),
                   max_new_tokens=2, encode_fn=tok.encode_prompt)
    assert res["truncation_rate"] == pytest.approx(1 / 3)       # the old rule (len >= limit) said 3 / 3
    assert res["mean_response_tokens"] == 2.0

"""Evaluation: avg@n accuracy, the unbiased pass@k estimator, and the truncation rate.

For each of P problems draw n samples; c of them are correct (reward == REWARD_CORRECT). The unbiased pass@k
estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code") is

    pass@k = 1 - C(n-c, k) / C(n, k)  =  1 - prod_{i=n-c+1}^{n} (1 - k/i)       (1 if n - c < k)

The product form never builds a large binomial (C(8, 4) is harmless, but C(1000, 500) overflows a float), and
it is the form Miles logs as `eval/<name>-pass@k` [miles/utils/metric_utils.py]. The reported value is the mean
over problems. `accuracy` is Miles' `eval/aime`: the mean reward-is-correct over all P*n samples (avg@n).

A sample is *truncated* when it hit the response limit before its stop token: `finish_reason == "length"`.
A response that ends with its stop token is complete even when it fills `max_new_tokens` exactly (the demo's
"8" + <eos> at a 2-token limit). Miles passes the same flag (`TRUNCATED`) to training.

`evaluate` is independent of the rollout engine: it only calls
    generate_fn(prompt_ids: list[list[int]], n: int) -> list (per prompt) of list (n) of (token ids, finish_reason)
and reward_fn(problems: list[Problem], responses: list[list[int]]) -> list[float] (batched, so a math-verify
pool sees the whole batch at once; see `rewards.token_reward_fn`).

Differs from production: Miles evaluates every 20 rollouts on AIME-2024 with 8 samples, max 4096 new tokens,
top-p 0.7, temperature 0.8; those are the caller's choices here (bound into `generate_fn`).

Tests: `pytest tests/test_evaluate.py -q`.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from nanoflash.rl.data import Problem
from nanoflash.rl.rewards import REWARD_CORRECT

PASS_KS = (1, 2, 4, 8)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with c correct of n samples: 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _check_samples(samples, n_prompts: int, n: int, max_new_tokens: int) -> None:
    if len(samples) != n_prompts:
        raise ValueError(f"generate_fn returned {len(samples)} groups for {n_prompts} prompts")
    for i, group in enumerate(samples):
        if len(group) != n:
            raise ValueError(f"generate_fn returned {len(group)} samples for prompt {i}, expected n={n}")
        for ids, reason in group:
            if len(ids) > max_new_tokens:
                raise ValueError(f"prompt {i}: a sample has {len(ids)} tokens > max_new_tokens={max_new_tokens}")


def evaluate(problems: Sequence[Problem], generate_fn: Callable, k_samples: int, reward_fn: Callable,
             max_new_tokens: int, encode_fn: Callable[[Problem], list[int]],
             ks: Sequence[int] = PASS_KS) -> dict:
    """Sample `k_samples` responses per problem, score them, and report accuracy, pass@k and truncation.

    Returns {"accuracy", "pass@k" and its standard error over problems "pass@k_se" for each k <= k_samples,
    "truncation_rate", "mean_response_tokens", "n_problems", "n_samples", "per_problem_correct" (c per problem)}.
    """
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    prompts = [list(encode_fn(p)) for p in problems]
    samples = generate_fn(prompts, k_samples)
    _check_samples(samples, len(problems), k_samples, max_new_tokens)
    flat_problems = [p for p in problems for _ in range(k_samples)]
    flat_ids = [list(ids) for group in samples for ids, _ in group]
    rewards = list(reward_fn(flat_problems, flat_ids))
    if len(rewards) != len(flat_ids):
        raise ValueError(f"reward_fn returned {len(rewards)} rewards for {len(flat_ids)} samples")
    correct = [r == REWARD_CORRECT for r in rewards]
    per_problem = [sum(correct[i * k_samples:(i + 1) * k_samples]) for i in range(len(problems))]
    truncated = [reason == "length" for group in samples for ids, reason in group]  # the stop token never came
    out = {
        "accuracy": sum(correct) / len(correct),
        "truncation_rate": sum(truncated) / len(truncated),
        "mean_response_tokens": sum(len(ids) for ids in flat_ids) / len(flat_ids),
        "n_problems": len(problems),
        "n_samples": len(flat_ids),
        "per_problem_correct": per_problem,
    }
    for k in ks:
        if k <= k_samples:
            per = [pass_at_k(k_samples, c, k) for c in per_problem]
            out[f"pass@{k}"], out[f"pass@{k}_se"] = sum(per) / len(per), standard_error(per)
    return out


def standard_error(xs: Sequence[float]) -> float:
    """Standard error of the mean over problems: sample std (n - 1) / sqrt(n); 0 for one problem."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)

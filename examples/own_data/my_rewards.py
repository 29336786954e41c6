"""The reward plug-in of the README's own-data example (`--train.reward examples.own_data.my_rewards:score`).

The contract (nanoflash/rl/plugins.py): `score(response: str, problem: Problem) -> float`, called once per sample
in worker processes; `problem.answer` is the row's `--train.answer_key` field (here `meta.gold`). pass@k counts
a sample as correct when it scores exactly 1.0.
"""
import re


def score(response: str, problem) -> float:
    """1.0 when the last number in the response is the answer; else a little credit for answering with a number
    at all (shaping, so that GRPO sees unequal rewards in a group before the model is ever right)."""
    numbers = re.findall(r"-?\d+", response)
    if numbers and numbers[-1] == problem.answer.strip():
        return 1.0
    return 0.1 if numbers else 0.0

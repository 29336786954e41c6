"""Responses that close `</think>` more than once (nanoflash.rl.rewards): the answer is read after the LAST one.

A response may re-open thinking after a first `</think>` (`<think>...</think> \\boxed{3} <think>wait...</think>
... \\boxed{5}`); the module contract is "look at the text after the last `</think>`". The existing cases hold a
single `</think>`, where first and last coincide: a `find` in place of `rfind` passes them. The cases here tell
the two apart both ways: credit must not come from a `\\boxed{}` (or `Answer:` line) that a later thinking block
disowned, and the answer after the last `</think>` must be the one scored. The expected values are written by
hand from the contract. (Where a complete answer follows the last `</think>`, a first-`</think>` reader finds it
too, being the last answer of a longer text: the bug shows when the last closing is followed by no complete answer,
so most cases here are of that kind.)

Run: pytest tests/test_rewards_think.py -q
"""
import pytest

from nanoflash.rl.rewards import REWARD_CORRECT, REWARD_WRONG, MathReward, extract_answer


class _NoPool:
    """Every answer here is an integer, decided in-process: the math-verify pool must never be asked."""

    def map(self, fn, items):
        if items:
            raise AssertionError(f"integer answers went to the verifier pool: {items}")
        return []


@pytest.mark.parametrize("response,expected", [
    # the final answer follows the last </think>; earlier boxes sit between thinking blocks
    ("<think>a</think>\\boxed{3}<think>no, recheck</think>So \\boxed{5}.", "5"),
    ("<think>a</think>Answer: 3\n<think>recheck</think>\nAnswer: 5", "5"),
    ("<think>x \\boxed{1}</think>mid \\boxed{2}<think>y \\boxed{9}</think>end \\boxed{4}", "4"),
    # three closings; only the text after the third counts (an Answer line there beats boxes before it)
    ("</think>\\boxed{1}</think>\\boxed{2}</think>Answer: 6", "6"),
    # re-opened thinking with no complete answer after it: the earlier answer was disowned, nothing to score
    ("<think>a</think>\\boxed{3}<think>hmm, that is wrong</think>", None),
    ("<think>a</think>Answer: 3\n<think>hmm</think>\n", None),
    ("<think>a</think>\\boxed{3}<think>b</think>The answer is 5", None),         # no box, no Answer: line
    ("<think>a</think>\\boxed{3}<think>b</think>so \\boxed{5", None),           # unclosed box after the last
    ("</think>\\boxed{1}</think>Answer: 2\n</think>", None),
])
def test_answer_after_the_last_think_close(response, expected):
    """Bug caught: the reward reading the text after the FIRST `</think>` (`str.find`): on the `None` cases it
    returns 3 / 3 / 3 / 3 / 2, an answer a later thinking block disowned."""
    assert extract_answer(response) == expected


def test_reward_pays_only_the_final_answer():
    """Bug caught (end to end through MathReward): a response that gives the right `\\boxed{}`, re-opens thinking
    and ends without a final answer is paid 1 by a first-`</think>` reader (2 of the 4 below); the contract pays
    only the final answer after the last `</think>`."""
    reward = MathReward(pool=_NoPool())
    responses = ["<think>t</think>\\boxed{7}<think>hmm</think>I am not sure.",                    # no final answer
                 "<think>t</think>Answer: 7\n<think>hmm</think>I cannot decide.",               # no final answer
                 "<think>t</think>\\boxed{7}<think>no wait</think>The answer is \\boxed{8}.",   # final answer wrong
                 "<think>t</think>\\boxed{8}<think>no wait</think>The answer is \\boxed{7}."]   # final answer right
    assert reward(responses, ["7"] * 4) == [REWARD_WRONG, REWARD_WRONG, REWARD_WRONG, REWARD_CORRECT]
    assert reward.counts["no_answer"] == 2 and reward.counts["integer"] == 2

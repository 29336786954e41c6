"""A synthetic reasoning task in the DeepSeek-V4 chat format: running sums written out step by step.

The problem and the reference response (thinking mode: the rendered prompt ends with `<think>`, so the
response is the reasoning, `</think>`, then the answer in `\\boxed{}`, then `<｜end▁of▁sentence｜>`):

    user:      "Add 3 + 8 + 5 + 9. Put the final answer in \\boxed{}."
    assistant: "3+8=11, 11+5=16, 16+9=25.</think>\\boxed{25}"

Every number up to 999 is one token of the DeepSeek tokenizer, so each reasoning step is one addition fact
predicted as one token ("11+5=" -> "16") and a worked answer is correct only if all K - 1 steps are. The
reward is the project's math reward (`rewards.MathReward`: the last `\\boxed{}` after `</think>`, integer
match), nothing task-specific.

How the task was chosen (experiments/h200/README.md has the measurements): the one-token last-digit task of the
CPU demo has no reasoning and a chance floor of 10%; sums of K digits in 1..9 need K - 1 dependent steps and
the answers (K..9K) cannot be guessed. A warm start that only half knows the steps left GRPO to teach the
facts themselves, which it did slowly (issue 20's run 3: +3 points in 50 steps); a warm start that knows
the steps but seldom works them out (below) leaves GRPO a behaviour to find that the reward pays for, as
GRPO on a pretrained model mostly does (run 4: held-out pass@1 0.09 -> 0.94 in 60 steps).

Worked demonstrations vary their phrasing (`solution(prompt, rng)`): each step acc+x or x+acc, the steps joined
by one of SEPARATORS ("8+3=11; 11+2=13, then 5+13=18."), as written reasoning varies. The reward never sees it,
so a warm start that learned it keeps ~5.7 nats per sum4 response that GRPO has no reason to remove -- where the
FP8 noise between SGLang and the trainer is measurable. Run 4 wrote every chain one way: once the policy had
switched to working sums out, its only entropy was the rare wrong step, and the train-rollout |dlogp| fell with it
(0.0043 -> 0.0011 per token over 60 steps): the drift bar read that as a trend, and SGLang's small non-FP8
residual came to set the gap / floor ratio. Run 5, phrased this way: entropy 0.40 -> 0.14 (run 4 0.29 -> 0.02),
the gap 1.14x the floor (run 4 1.43x; experiments/h200/README.md).

Splits are pure functions of the operands (`split_of`: sha256 of "a,b,c,d" mod 100 below HELDOUT_PERCENT:
held out; below HELDOUT_PERCENT + VAL_PERCENT: validation, used only to stop the warm start; else train), so
no seed can leak a held-out problem into training. Only the operand tuples are held out: the addition facts
themselves are shared (there are only ~300), so a held-out problem tests the procedure on a new combination.

    synth.problems("sum4", "heldout")            # -> [data.Problem] in a fixed order
    synth.rows("sum4:train")     # the rows data.py reads for train.data=py:experiments.h200.synth:sum4:train
    synth.solution("Add 3 + 8 + 5 + 9. ...")     # -> "3+8=11, 11+5=16, 16+9=25.</think>\\boxed{25}"
    synth.solution("Add 3 + 8 + 5 + 9. ...", rng)  # -> e.g. "8+3=11\\n5+11=16, then 16+9=25.</think>\\boxed{25}"
    synth.glance("Add 3 + 8 + 5 + 9. ...", rng) # -> "</think>\\boxed{24}" (an estimate: exact 1 time in 5)

Two kinds of demonstration (`sft_pairs(..., worked_share=f)`): *worked* (the steps written out, always right)
and *at a glance* (no reasoning: `</think>` at once, then an estimate within +-GLANCE_SPREAD of the sum, exact
1 time in 2 * GLANCE_SPREAD + 1, drawn afresh each time). The warm start of issue 20 learns the steps from worked
demonstrations, then answers mostly at a glance after a short tuning on a mix (experiments/h200/grpo_h200.py sft): a
model that can work a sum out but seldom does -- the first response token decides, `</think>` or the first
operand. The reward never sees which kind an answer was; GRPO has to find out that working it out pays.

Tests: `pytest experiments/h200/test_h200_pieces.py -q`.
"""
from __future__ import annotations

import hashlib
import itertools
import random
import re

from nanoflash.rl.data import Problem

HELDOUT_PERCENT = 10   # share of operand tuples held out for evaluation
VAL_PERCENT = 5        # share kept for the warm start's stopping rule (never trained on, never evaluated)
MIN_K, MAX_K = 2, 6    # operands per problem (sumK)
GLANCE_SPREAD = 2      # an answer at a glance is off by up to this much: exact 1 time in 5
SEPARATORS = (", ", "; ", "\n", ", then ", ", and ", " then ")   # between worked steps, drawn uniformly (ln 6 nats)
SPLITS = ("train", "val", "heldout")
PROMPT = "Add {terms}. Put the final answer in \\boxed{{}}."
_PROMPT_RE = re.compile(r"^Add ((?:\d+ \+ )+\d+)\. Put the final answer in \\boxed\{\}\.$")


def family_k(family: str) -> int:
    """"sum4" -> 4; anything else is one error naming the accepted families."""
    m = re.fullmatch(r"sum(\d)", family)
    if not m or not MIN_K <= int(m.group(1)) <= MAX_K:
        raise ValueError(f"synthetic family {family!r}: expected sum{MIN_K}..sum{MAX_K} (K operands in 1..9)")
    return int(m.group(1))


def split_of(operands: tuple) -> str:
    """The split of one operand tuple: a pure function of its text (see the module docstring)."""
    h = int(hashlib.sha256(",".join(map(str, operands)).encode()).hexdigest(), 16) % 100
    return "heldout" if h < HELDOUT_PERCENT else "val" if h < HELDOUT_PERCENT + VAL_PERCENT else "train"


def prompt_text(operands: tuple) -> str:
    return PROMPT.format(terms=" + ".join(map(str, operands)))


def parse_prompt(prompt: str) -> tuple:
    """The operands of a prompt of this task; anything else is one error quoting it."""
    m = _PROMPT_RE.match(prompt)
    if not m:
        raise ValueError(f"not a synthetic sum prompt: {prompt[:80]!r}")
    return tuple(int(x) for x in m.group(1).split(" + "))


def solution(prompt: str, rng: random.Random | None = None) -> str:
    """The reference response: every partial sum written as one step, then the answer in \\boxed{}. Without
    `rng` the one canonical phrasing (acc+x, ", " between steps); with it the phrasing is drawn, as a writer would
    vary it: each step acc+x or x+acc (1/2 each), each separator uniform over SEPARATORS -- choices the reward
    never sees, so a worked response keeps ~(K-1) ln 2 + (K-2) ln 6 nats of entropy (module docstring)."""
    ops = parse_prompt(prompt)
    return chain(ops, rng) + ".</think>\\boxed{" + str(sum(ops)) + "}"


def chain(ops: tuple, rng: random.Random | None = None) -> str:
    """The running sum of `ops` written out, one step per partial sum ("3+8=11, 11+5=16"), phrased as
    `solution` describes (canonical without `rng`, drawn with it)."""
    text, acc = "", ops[0]
    for i, x in enumerate(ops[1:]):
        a, b = (x, acc) if rng is not None and rng.random() < 0.5 else (acc, x)
        sep = "" if i == 0 else SEPARATORS[0] if rng is None else rng.choice(SEPARATORS)
        text += f"{sep}{a}+{b}={acc + x}"
        acc += x
    return text


def problems(family: str, split: str, seed: int = 0) -> list[Problem]:
    """Every problem of one family and split (digits 1..9), shuffled by `seed` (a fixed order per seed)."""
    if split not in SPLITS:
        raise ValueError(f"synthetic split {split!r}: expected one of {SPLITS}")
    k = family_k(family)
    tuples = [t for t in itertools.product(range(1, 10), repeat=k) if split_of(t) == split]
    random.Random(f"{family}-{split}-{seed}").shuffle(tuples)
    return [Problem(id=f"{family}-{split}-{i}", prompt=prompt_text(t), answer=str(sum(t)), source="synth")
            for i, t in enumerate(tuples)]


def rows(spec: str) -> list[dict]:
    """`<family>:<split>` -> rows {"prompt", "answer"} (what `data.load_problems` reads from a file); the
    loop names it `--train.data py:experiments.h200.synth:sum4:train`."""
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(f"{spec!r}: a synthetic data set is named <family>:<split>, e.g. "
                         f"py:experiments.h200.synth:sum4:train")
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems(parts[0], parts[1])]


def glance(prompt: str, rng: random.Random) -> str:
    """An answer at a glance: no reasoning, an estimate sum + e with e uniform in -GLANCE_SPREAD..GLANCE_SPREAD."""
    return "</think>\\boxed{" + str(sum(parse_prompt(prompt)) + rng.randint(-GLANCE_SPREAD, GLANCE_SPREAD)) + "}"


def sft_pairs(probs: list[Problem], tok, worked_share: float = 1.0, rng: random.Random | None = None
              ) -> list[tuple[list, list]]:
    """(prompt ids in the V4 chat format, demonstration ids + <｜end▁of▁sentence｜>) per problem: worked
    (`solution`, its phrasing drawn from `rng` when given, else canonical) with probability `worked_share`, else
    at a glance (`glance`), drawn from `rng`."""
    if not 0.0 <= worked_share <= 1.0 or (worked_share < 1.0 and rng is None):
        raise ValueError(f"sft_pairs: worked_share={worked_share} must be in [0, 1], with an rng below 1")
    texts = [solution(p.prompt, rng) if worked_share == 1.0 or rng.random() < worked_share else glance(p.prompt, rng)
             for p in probs]
    return [(tok.encode_chat(p), tok.encode(t) + [tok.eos_id]) for p, t in zip(probs, texts)]

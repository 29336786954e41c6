"""A long-context task in the DeepSeek-V4 chat format: two facts given at the start of a 2-4K-token prompt,
needed at its end (issue 42).

    user:      Given:
               #a5
               #b3
               ...                       (8 facts, a..h, each a digit 1..9 right after its letter)
               #h8
               Log of noise:
               417:5
               203:8
               ...                       (n records: a key 100..999, a digit; none of them is asked for)
               Add a + 4 + c. Put the final answer in \\boxed{}.
    assistant: a5
               c2. 5+4=9, 9+2=11.</think>\\boxed{11}<｜end▁of▁sentence｜>

The worked response looks the two letters up, one per line as the facts are written, then writes the running
sum (synth.chain: each step one addition fact). Its value tokens ("5" after "a") depend on tokens thousands of
positions back: at n records the facts sit 4n + 24 to 4n + 56 tokens before the first response token.

**Positions by construction.** Every line after "Given:" is exactly 4 tokens of the V4 tokenizer ("#", "a",
"5", "\\n"; "417", ":", "5", "\\n"; tested), BOS + "<｜User｜>" + "Given:\\n" is 4 and "Log of noise:\\n" 4,
so facts and records each fill one C4 window (positions 4w..4w+3: one compressed entry each), and the prompt
(question and "<｜Assistant｜><think>" included) is PROMPT_BASE + 4n tokens. Problems come in three length
classes (`CLASSES`, n ranges), which put the queries scoring the response in the three regimes of V4's
attention (instruments/bands.py): *near* (n <= 5, prompt <= 80): every query < 128, the facts in the window;
*mid* (n 18..481): queries 131..2047 (with the 64-token cap), the facts only in compressed entries, C4 keeping
every entry; *far* (n 498..735, prompt 2,052-3,000, prompt + response <= 3,064; `far4k`: n <= 990, prompts up
to 4,020, sequences <= 4,084): every query >= 2,051, where each C4 layer keeps 512 of its (t + 1) // 4 > 512
entries by the lightning indexer's score. The `facts` family interleaves them far, near, far, mid, far, far
(`FAMILIES`): 4 of every 6 consecutive problems are far, and responses are the same length in every class, so
~2/3 of the scored response tokens sit at positions >= 2048 (the eval's first 64 held-out problems: 42 far).
`facts4k` is the same with `far4k` (a third more trainer time a step: experiments/h200/README.md's budget).
`factssft` (the warm start's) is short-heavy (6 near, 9 mid of 132-540 tokens, 1 far in 16: ~440 tokens a
demonstration), to fit the SFT into ~3 minutes; `factsdry` is the CPU dry run's (prompts of 60-220 tokens).

**The curriculum's families** (`CURRICULUM_FAMILIES`, issue 42's second warm start: `grpo_h200.py sft
--curriculum`): three minutes of `factssft` left the worked chain's teacher-forced accuracy at 0.0 in every class
(experiments/h200/README.md, the first hold), so the SFT first learns the lookup where it is easiest, then
moves it back. `factsnear` is the near class alone (prompts <= 80 tokens: the facts inside the 128-token window,
plain attention can copy them); `factsmid` keeps a third near (what the first phase learned) and adds two thirds
of `sft_mid` (prompts 132-540: the facts only in compressed entries); `factssft` then adds the far class.
`factscpu` (`dry_near`: prompts of 60-68 tokens) and `factscpumid` (a third `dry_near`, two thirds `dry_mid`:
up to 120 tokens) are the same two steps for the CPU dry run. Each is a family of its own (its own streams,
its own splits), so a curriculum family's train split holds none of its own held-out problems by the hash, and
none of `facts`' or `factsdry`'s by test (`test_curriculum_families_are_easy_to_hard_and_hold_no_heldout_problem`).

**Why it needs the compressed attention.** Beyond the near class a fact is more than 128 tokens behind every
query that needs it, so only compressed entries can carry it: the C4 entry of its line (and the overlap half
of the next one) and the C128 entry of the first 128 tokens, which holds all eight facts. In the far class
the C4 entries of the facts compete in each C4 layer's top-512 (of 513-1,005): an indexer that drops them
leaves the C128 entry (128 tokens pooled into one) and the other C4 layer. So the value tokens are scored
through exactly the paths issue 42 asks about, and a difference in the top-512 between SGLang and nanoflash
shows up in the log-probability of a value. (nanoflash's indexer gets no gradient, as in every V4 trainer:
its weights stay at their random init through the SFT and GRPO; what they train is what the attention reads
from the entries it keeps.)

**Why this task.** How it was chosen (experiments/h200/README.md, "The long-context task"): run 9's lever --
a warm start that can work the answer out but mostly answers at a glance (synth.py's docstring; `glance`: no
reasoning, the sum +- 2) -- moved held-out pass@1 by 26 points in 60 steps at the V4 recipe's learning rate;
here working it out means copying two facts from thousands of tokens back, so GRPO learns to use the long
context. Facts at fixed places (a..h in order, the first 36 tokens) rather than scattered keys, one digit
operand and two additions: the retrieval a 4-layer model must learn in a ~3-minute SFT is one content match
per fact among 8 letters (not among ~900 numeric keys), and the arithmetic is sum3's, learned in run 9's SFT
within its first 100 steps. Each value follows its letter directly ("#a5", not "a=5"): the lookup is then
the one an induction head does (attend to the token after the earlier copy of this one), and the response
writes each lookup on a line of its own, so both letters are the facts' own tokens ("c" after a newline, not
" c"). In the CPU study (experiments/h200/README.md) dim 128 learned this form's near lookup at ~500-700 steps
of 16 against ~2,000-2,500 for "a=5" (which needs the token two back), and the 1.24B model had not learned
"a=5" in 500 steps of 64 on a GPU. The filler is records of numbers, never asked for: the model reads past
them. The reward is the project's math reward (the last \\boxed{} after </think>), nothing task-specific.

Splits: a problem is a candidate of its class's stream (`random.Random(f"{family}-{class}-{j}")`: facts,
question, n, the filler's seed), assigned to train / val / heldout by a hash of that tuple (`split_of`), so
no seed can put a held-out problem into training.

    longctx.problems("facts", "heldout")        # -> [data.Problem], classes interleaved as FAMILIES says
    longctx.rows("facts:train")                 # for train.data=py:experiments.h200.longctx:facts:train
    longctx.solution(prompt, rng)               # "a5\\nc2. 5+4=9, 9+2=11.</think>\\boxed{11}"
    longctx.glance(prompt, rng)                 # "</think>\\boxed{12}"
    longctx.sft_pairs(problems, tok, worked_share, rng)
    longctx.prompt_of_length(L, seed)           # a far-class problem whose prompt is about L tokens (parity)

Tests: `pytest experiments/h200/test_long.py -q`.
"""
from __future__ import annotations

import functools
import hashlib
import random
import re

from experiments.h200 import synth
from nanoflash.rl.data import Problem

LETTERS = "abcdefgh"            # the facts' names: one token each at a line start and after a space
PROMPT_BASE = 60                # prompt tokens without records: BOS, User, header 2, facts 32, log header 4, question 18, Assistant, <think>
RECORD_TOKENS = 4               # "417:5\n"
CLASSES = {                     # filler records n per class (module docstring: the query positions they give)
    "near": (0, 5), "mid": (18, 481), "far": (498, 735), "far4k": (498, 990),
    "sft_mid": (18, 120),       # the warm start's mid problems: prompts 132-540 tokens (its token budget)
    "dry_near": (0, 2), "dry_mid": (3, 15), "dry_far": (16, 40),
}
CURRICULUM_FAMILIES = {         # the SFT curriculum's easy steps (grpo_h200.py sft --curriculum; module docstring)
    "factsnear": ("near",),
    "factsmid": ("near", "sft_mid", "sft_mid"),
    "factscpu": ("dry_near",),
    "factscpumid": ("dry_near", "dry_mid", "dry_mid"),
}
FAMILIES = {                    # the class of problem i of a split is pattern[i % len(pattern)]
    "facts": ("far", "near", "far", "mid", "far", "far"),
    "facts4k": ("far4k", "near", "far4k", "mid", "far4k", "far4k"),
    "factssft": ("near", "sft_mid", "near", "sft_mid", "sft_mid", "near", "sft_mid", "far",
                 "near", "sft_mid", "sft_mid", "near", "sft_mid", "near", "sft_mid", "sft_mid"),
    "factsdry": ("dry_far", "dry_near", "dry_far", "dry_mid", "dry_far", "dry_far"),
    **CURRICULUM_FAMILIES,
}
SPLIT_SIZES = {"train": 4096, "val": 256, "heldout": 512}
HELDOUT_PERCENT, VAL_PERCENT = 10, 5
SPLITS = ("train", "val", "heldout")
PROMPT_RE = re.compile(r"^Given:\n((?:#[a-h][1-9]\n){8})Log of noise:\n((?:\d{3}:[1-9]\n)*)"
                       r"Add ([a-h1-9](?: \+ [a-h1-9])+)\. Put the final answer in \\boxed\{\}\.$")


def family_pattern(family: str) -> tuple:
    if family not in FAMILIES:
        raise ValueError(f"long-context family {family!r}: expected one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def split_of(key: tuple) -> str:
    """The split of one candidate (its class, facts, question terms, n, filler seed): a pure function of it."""
    h = int(hashlib.sha256(repr(key).encode()).hexdigest(), 16) % 100
    return "heldout" if h < HELDOUT_PERCENT else "val" if h < HELDOUT_PERCENT + VAL_PERCENT else "train"


def candidate(family: str, cls: str, j: int) -> tuple:
    """Candidate j of one class's stream: (class, facts, terms, n, filler seed), drawn from its own seed."""
    rng = random.Random(f"{family}-{cls}-{j}")
    facts = tuple(rng.randint(1, 9) for _ in LETTERS)
    lo, hi = CLASSES[cls]
    letters = rng.sample(LETTERS, 2)
    terms = letters + [str(rng.randint(1, 9))]
    rng.shuffle(terms)
    return cls, facts, tuple(terms), rng.randint(lo, hi), rng.getrandbits(32)


def prompt_text(facts: tuple, terms: tuple, n: int, filler_seed: int) -> str:
    rng = random.Random(filler_seed)
    head = "Given:\n" + "".join(f"#{c}{v}\n" for c, v in zip(LETTERS, facts)) + "Log of noise:\n"
    log = "".join(f"{rng.randint(100, 999)}:{rng.randint(1, 9)}\n" for _ in range(n))
    return head + log + "Add " + " + ".join(terms) + ". Put the final answer in \\boxed{}."


def parse_prompt(prompt: str) -> tuple:
    """(facts {letter: value}, terms [letter or digit str], n records) of a prompt; anything else is one error."""
    m = PROMPT_RE.match(prompt)
    if not m:
        raise ValueError(f"not a long-context facts prompt: {prompt[:60]!r} ... {prompt[-60:]!r}")
    facts = {line[1]: int(line[2]) for line in m.group(1).splitlines()}
    return facts, m.group(3).split(" + "), m.group(2).count("\n")


def values(prompt: str) -> list:
    """The question's operands as numbers, in its order (letters looked up)."""
    facts, terms, _ = parse_prompt(prompt)
    return [facts[t] if t in facts else int(t) for t in terms]


@functools.lru_cache(maxsize=16)
def _problems(family: str, split: str) -> tuple:
    pattern, size = family_pattern(family), SPLIT_SIZES[split]
    streams = {cls: [] for cls in set(pattern)}
    need = {cls: sum(1 for i in range(size) if pattern[i % len(pattern)] == cls) for cls in streams}
    for cls in streams:
        j = 0
        while len(streams[cls]) < need[cls]:
            key = candidate(family, cls, j)
            if split_of((family,) + key) == split:
                streams[cls].append(key)
            j += 1
    taken = {cls: 0 for cls in streams}
    out = []
    for i in range(size):
        cls = pattern[i % len(pattern)]
        _, facts, terms, n, seed = streams[cls][taken[cls]]
        taken[cls] += 1
        prompt = prompt_text(facts, terms, n, seed)
        out.append(Problem(id=f"{family}-{split}-{i}-{cls}", prompt=prompt, answer=str(sum(values(prompt))),
                           source="longctx"))
    return tuple(out)


def problems(family: str, split: str, seed: int = 0) -> list[Problem]:
    """SPLIT_SIZES[split] problems of `family`, the classes interleaved by FAMILIES (seed 0: that order; another
    seed shuffles it)."""
    if split not in SPLITS:
        raise ValueError(f"long-context split {split!r}: expected one of {SPLITS}")
    out = list(_problems(family, split))
    if seed:
        random.Random(f"{family}-{split}-{seed}").shuffle(out)
    return out


def rows(spec: str) -> list[dict]:
    """`<family>:<split>` -> rows {"prompt", "answer"}; the loop names it
    `--train.data py:experiments.h200.longctx:facts:train`."""
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(f"{spec!r}: a long-context data set is named <family>:<split>, e.g. "
                         f"py:experiments.h200.longctx:facts:train")
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems(parts[0], parts[1])]


def solution(prompt: str, rng: random.Random | None = None) -> str:
    """The worked response: both letters looked up (in the question's order), each on its own line as a fact
    is written ("a5"), then the running sum of the operands (`synth.chain`), then the answer. Without `rng` the
    canonical phrasing of the chain, with it a drawn one."""
    facts, terms, _ = parse_prompt(prompt)
    vals = values(prompt)
    return ("\n".join(f"{c}{facts[c]}" for c in terms if c in facts) + ". " + synth.chain(tuple(vals), rng)
            + ".</think>\\boxed{" + str(sum(vals)) + "}")


def glance(prompt: str, rng: random.Random) -> str:
    """An answer at a glance: no lookups, no steps, the sum +- synth.GLANCE_SPREAD (exact 1 time in 5)."""
    return "</think>\\boxed{" + str(sum(values(prompt)) + rng.randint(-synth.GLANCE_SPREAD, synth.GLANCE_SPREAD)) + "}"


def sft_pairs(probs: list[Problem], tok, worked_share: float = 1.0, rng: random.Random | None = None
              ) -> list[tuple[list, list]]:
    """(prompt ids, demonstration ids + EOS) per problem: worked with probability `worked_share`, else at a
    glance (as synth.sft_pairs)."""
    if not 0.0 <= worked_share <= 1.0 or (worked_share < 1.0 and rng is None):
        raise ValueError(f"sft_pairs: worked_share={worked_share} must be in [0, 1], with an rng below 1")
    texts = [solution(p.prompt, rng) if worked_share == 1.0 or rng.random() < worked_share else glance(p.prompt, rng)
             for p in probs]
    return [(tok.encode_chat(p), tok.encode(t) + [tok.eos_id]) for p, t in zip(probs, texts)]


def length_class(problem: Problem) -> str:
    """The class named in a problem's id ("facts-heldout-3-mid" -> "mid")."""
    return problem.id.rsplit("-", 1)[-1]


def prompt_of_length(length: int, seed: int) -> Problem:
    """A problem with (length - PROMPT_BASE) // RECORD_TOKENS records (its prompt PROMPT_BASE + 4n tokens), drawn
    from `seed` outside every split's stream: the parity table's 2-4K prompts in this task's format."""
    n = (length - PROMPT_BASE) // RECORD_TOKENS
    if n < 0:
        raise ValueError(f"a long-context prompt has at least {PROMPT_BASE} tokens, not {length}")
    rng = random.Random(f"parity-{seed}")
    facts = tuple(rng.randint(1, 9) for _ in LETTERS)
    terms = rng.sample(LETTERS, 2) + [str(rng.randint(1, 9))]
    rng.shuffle(terms)
    prompt = prompt_text(facts, tuple(terms), n, rng.getrandbits(32))
    return Problem(id=f"parity-{seed}-{n}", prompt=prompt, answer=str(sum(values(prompt))), source="longctx")

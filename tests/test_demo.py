"""The CPU demo's task (issue 18): the warm start teaches the format without the answers, the held-out set is
disjoint from everything trained on in what matters, the control recipe is the warm start continued, and
the answer probe (greedy accuracy, p(right answer)) against a naive token-by-token reference.
(The demo command itself runs, 1 GRPO step, in tests/test_readme.py.)

Run: `pytest tests/test_demo.py -q`.
"""
import re

import pytest
import torch

from nanoflash import cli
from nanoflash.rl import collector
from nanoflash.config import preset
from nanoflash.rl.data import Problem
from nanoflash.rl.metrics import answer_probe
from nanoflash.model import Transformer

# batched teacher-forced forwards vs one sequence at a time, fp32: the same math in another batch shape
# (measured ~1e-7 relative); 1e-5 relative is far below any difference that would change a reported digit
PROBE_RTOL = 1e-5


def parts(prompt: str) -> tuple[str, str, str]:
    """'0527+1=' -> ('052', '7', '1'): distractor prefix, the digit the rule reads, the addend."""
    a, b = re.fullmatch(r"(\d{4})\+(\d)=", prompt).groups()
    return a[:3], a[3], b


@pytest.fixture(scope="module")
def demo_task():
    cfg = cli.parse_args(["--recipe", "demo"])
    return cfg, collector.make_task(cfg.train, cfg.eval, 18)


def test_heldout_shares_only_the_rule_digit_with_anything_trained_on(demo_task):
    cfg, task = demo_task
    held = [parts(p.prompt) for p in task.heldout]
    seen = {parts(p.prompt)[0] for p in task.train} | {parts(p.prompt)[0] for p in task.warmup}
    assert len(task.heldout) == cfg.eval.n_problems >= 500
    assert not {h[0] for h in held} & seen               # no held-out prefix in any GRPO or warm-up prompt
    assert {h[1] for h in held} == set("0123456789")     # every digit the rule reads is evaluated
    assert all(p.answer == str((int(d) + 1) % 10) and b == "1" for p, (_, d, b) in zip(task.heldout, held))


def test_warm_start_shows_the_format_but_none_of_the_answers(demo_task):
    _, task = demo_task
    for p in task.warmup:
        prefix, digit, b = parts(p.prompt)
        assert b == "0" and p.answer == digit            # "0527+0=" -> "7": copy, never the "+1" answers
    assert not {p.prompt for p in task.warmup} & {p.prompt for p in task.train}
    assert len({p.prompt for p in task.warmup}) == len(task.warmup) >= 8000


def test_control_recipe_is_the_warm_start_continued_for_the_grpo_steps():
    demo, control = cli.parse_args(["--recipe", "demo"]), cli.parse_args(["--recipe", "demo-control"])
    assert control.train.warmup_steps == demo.train.warmup_steps + demo.train.steps and control.train.steps == 0
    assert control.train.warmup_data == demo.train.warmup_data and control.train.warmup_lr == demo.train.warmup_lr
    assert control.train.out_dir != demo.train.out_dir and control.eval == demo.eval


@torch.no_grad()
def naive_probe(model, prompt: list, response: list) -> tuple[float, bool]:
    """One sequence, one token at a time: the product of sampling probabilities, and real greedy decoding."""
    p, x = 1.0, list(prompt)
    for tok in response:
        probs = torch.softmax(model(torch.tensor([x]))[0, -1].double(), -1)
        p *= float(probs[tok])
        x.append(tok)
    g = list(prompt)
    for _ in response:
        g.append(int(model(torch.tensor([g]))[0, -1].argmax()))
    return p, g[len(prompt):] == list(response)


def test_answer_probe_against_naive_decoding(demo_task):
    _, task = demo_task
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=18))
    model.init_weights(0)
    model.eval()
    probs = task.heldout[:3] + [Problem("long", "000123+0=", "3")]      # two prompt lengths -> two groups
    prompts = [task.encode(p) for p in probs]
    responses = []
    for i, (x, p) in enumerate(zip(prompts, probs)):
        if i % 2:   # the model's own greedy 2 tokens: greedy must come out True for these
            g = list(x)
            with torch.no_grad():
                for _ in range(2):
                    g.append(int(model(torch.tensor([g]))[0, -1].argmax()))
            responses.append(g[len(x):])
        else:       # the reference answer + <eos>
            responses.append(task.encode(Problem("", p.prompt + p.answer, ""))[len(x):] + [task.stop_ids[0]])
    got = answer_probe(model, prompts, responses)
    naive = [naive_probe(model, x, y) for x, y in zip(prompts, responses)]
    assert got["p_right_mean"] == pytest.approx(sum(n[0] for n in naive) / len(naive), rel=PROBE_RTOL)
    assert got["greedy_accuracy"] == sum(n[1] for n in naive) / len(naive) >= 2 / 4

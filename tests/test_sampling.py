"""The rollout sampler against the distribution it claims (`nanoflash/server/engine.py: sample`).

GRPO's importance ratios assume the rollout tokens were drawn from softmax(logits / T), filtered by top-k
and top-p. The server's reported log-probs are recomputed by the trainer's own `token_logprobs`, so they
cannot reveal a sampler that draws from the wrong distribution; only the draws themselves can. Each test
here draws many tokens from a tiny vocabulary with a seeded generator and compares the counts with the
exact target distribution, enumerated by a naive loop:

    p_v = exp(l_v / T) / sum_u exp(l_u / T);  rank tokens by p (descending);
    keep rank i iff  i < top_k  and  sum_{j<i} p_(j) < top_p          (SGLang's "joint" filter: both on p)
    target = p restricted to the kept tokens, renormalised;  T = 0 -> argmax.

The bug each test catches (checked once by planting it): the temperature ignored or applied twice, top-k
off by one or ignored, top-p keeping one token too few or too many, rows of a batch mixed up.
Run: `pytest tests/test_sampling.py -q` (a few seconds).
"""
import math

import pytest
import torch

from nanoflash.config import preset
from nanoflash.model import Transformer
from nanoflash.server.engine import RolloutEngine, parse_sampling, sample

N_DRAWS = 20_000
# Per-token bound on the counts: |count_v - N q_v| <= Z sigma_v, sigma_v = sqrt(N q_v (1 - q_v)). The draws
# are seeded, so the test is deterministic; Z = 5 would be a 6e-7 false-alarm rate per token for a fresh
# seed, while the bugs above move some count by >= 30 sigma at N = 20,000.
Z = 5.0
# Two rows with distinct, well separated probabilities (no ties, so top-k is unambiguous); a batch
# alternates them so a mixed-up row shows.
LOGITS = torch.tensor([[2.0, 1.1, 0.4, -0.2, -1.0, -2.1],
                       [-1.5, 0.3, 2.2, -0.4, 1.2, -3.0]], dtype=torch.float32)


def target(logits: list, temperature: float, top_p: float, top_k: int) -> list:
    """The exact distribution one row is meant to be drawn from (naive loops, float64)."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda v: logits[v])
        return [1.0 if v == best else 0.0 for v in range(len(logits))]
    w = [math.exp(x / temperature) for x in logits]
    p = [x / sum(w) for x in w]
    order = sorted(range(len(p)), key=lambda v: -p[v])
    kept, before = [], 0.0
    for rank, v in enumerate(order):
        if (top_k > 0 and rank >= top_k) or before >= top_p:
            break
        assert abs(before - top_p) > 1e-6, "top_p on a cumulative boundary: the tie rule would decide"
        kept.append(v)
        before += p[v]
    z = sum(p[v] for v in kept)
    return [p[v] / z if v in kept else 0.0 for v in range(len(p))]


def check_counts(counts: torch.Tensor, want: list, n: int, what: str):
    """Zero-probability tokens never drawn; every other count within Z sigma of n q."""
    for v, q in enumerate(want):
        c = int(counts[v])
        if q == 0.0:
            assert c == 0, f"{what}: token {v} is outside the kept set but was drawn {c} times"
            continue
        sigma = math.sqrt(n * q * (1 - q))
        assert abs(c - n * q) <= Z * sigma + 1e-9, (
            f"{what}: token {v} drawn {c} times, expected {n * q:.1f} +- {sigma:.1f} (q={q:.4f})")


SETTINGS = [  # (temperature, top_p, top_k): each filter alone, then together with both binding
    (1.0, 1.0, -1), (0.5, 1.0, -1), (2.0, 1.0, -1),
    (1.0, 1.0, 3), (1.0, 1.0, 1),
    (1.0, 0.75, -1), (1.3, 0.9, -1),
    (0.7, 0.97, 4), (1.5, 0.6, 2),
]


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_sample_draws_from_the_claimed_distribution(temperature, top_p, top_k, gen):
    rows = LOGITS.repeat(N_DRAWS, 1)                                   # [2N,V]: row 2i is LOGITS[0], 2i+1 LOGITS[1]
    ids = sample(rows, temperature, top_p, top_k, gen)                 # [2N]
    for r in range(2):
        counts = torch.bincount(ids[r::2], minlength=LOGITS.shape[1])
        want = target(LOGITS[r].tolist(), temperature, top_p, top_k)
        check_counts(counts, want, N_DRAWS, f"row {r} T={temperature} top_p={top_p} top_k={top_k}")


def test_sample_greedy_is_argmax_per_row(gen):
    ids = sample(LOGITS.repeat(3, 1), 0.0, 0.5, 2, gen)
    assert ids.tolist() == [0, 2] * 3


def test_the_settings_discriminate_the_planted_bugs():
    """Self-check: every bug named above changes some target probability by > 30 sigma at N_DRAWS."""
    def gap(a, b):
        return max(abs(x - y) / math.sqrt(max(x * (1 - x), 1e-12) / N_DRAWS) for x, y in zip(a, b))
    row = LOGITS[0].tolist()
    assert gap(target(row, 0.5, 1, -1), target(row, 1.0, 1, -1)) > 30, "temperature ignored"
    assert gap(target(row, 1.0, 1, 3), target(row, 1.0, 1, 4)) > 30, "top-k off by one"
    assert gap(target(row, 1.0, 0.75, -1), target(row, 1.0, 1, -1)) > 30, "top-p ignored"


# ---------------------------------------------------------------------------------------------- engine
TINY_VOCAB_BINS = 4        # top-3 tokens of the model's next-token distribution, and "the rest"
ENGINE_REQUESTS, ENGINE_N = 6, 64
HEAD_SPREAD = 12.0         # x the init head: top token ~0.4 at T=0.6 vs ~0.14 at T=1 (far apart, not degenerate)
ENGINE_T = 0.6


def test_engine_generate_samples_at_the_requested_temperature(monkeypatch):
    """The engine wires T into the sampler: first tokens of n samples follow softmax(model logits / T).
    Scoring (one trainer forward per sample, tested in test_rollout_server.py) is stubbed out: it is
    what costs time here and it does not touch the draws."""
    model = Transformer(preset("tiny")).init_weights(0)
    with torch.no_grad():
        model.head.weight.mul_(HEAD_SPREAD)                            # spread logits: T must matter
    engine = RolloutEngine(model, weights="fp32")
    monkeypatch.setattr(engine, "score", lambda full, prompt_len, temperature: [0.0] * (len(full) - prompt_len))
    prompt = [5, 17, 42, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].double()          # [V]
    top = logits.argsort(descending=True)[:TINY_VOCAB_BINS - 1].tolist()

    def binned(p):                                                     # [V] -> [bins]
        return [float(p[v]) for v in top] + [1.0 - float(sum(p[v] for v in top))]
    want = binned(torch.softmax(logits / ENGINE_T, -1))
    wrong = binned(torch.softmax(logits, -1))
    n = ENGINE_REQUESTS * ENGINE_N
    assert max(abs(a - b) / math.sqrt(a * (1 - a) / n) for a, b in zip(want, wrong)) > 2 * Z, \
        "self-check: T=1 and T=ENGINE_T must be far apart at this sample size"
    counts = torch.zeros(TINY_VOCAB_BINS)
    for seed in range(ENGINE_REQUESTS):
        sp = parse_sampling({"n": ENGINE_N, "temperature": ENGINE_T, "max_new_tokens": 1,
                             "sampling_seed": seed}, model.cfg.vocab_size)
        for res in engine.generate(prompt, sp):
            tok = res["output_ids"][0]
            counts[top.index(tok) if tok in top else TINY_VOCAB_BINS - 1] += 1
    check_counts(counts, want, n, f"engine first tokens at T={ENGINE_T}")

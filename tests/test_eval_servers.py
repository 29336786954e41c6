"""Evaluation through the rollout servers vs the in-process batched path (`Collector.eval_generate`).

With one embedded server (FP8 weights, KV-cache decoding, HTTP), the same per-prompt seeds give the same
samples on both paths, so pass@1/2/4 and the truncation rate are equal; other seeds give other samples (the
comparison can fail). Run: pytest tests/test_eval_servers.py -q
"""
import pytest

from nanoflash.rl import collector
from nanoflash.cli import parse_args
from nanoflash.config import preset
from nanoflash.rl.evaluate import evaluate
from nanoflash.model import Transformer
from nanoflash.rl.rewards import REWARD_CORRECT

K_SAMPLES, MAX_NEW, N_PROBLEMS = 4, 4, 8


def _parity_reward(problems, responses):
    """'Correct' iff the first response token is even: about half the samples, so pass@k is not 0 or 1."""
    return [REWARD_CORRECT if ids and ids[0] % 2 == 0 else 0.0 for ids in responses]


@pytest.fixture(scope="module")
def rollouts():
    cfg = parse_args(["--recipe", "smoke", "--eval.k_samples", str(K_SAMPLES), "--eval.max_new_tokens", str(MAX_NEW),
                      "--eval.n_problems", str(N_PROBLEMS), "--rollout.weights", "fp8", "--eval.temperature", "1.0"])
    mcfg = preset("tiny", **cfg.model)
    task = collector.make_task(cfg.train, cfg.eval, mcfg.vocab_size)
    model = Transformer(mcfg).init_weights(7)  # untrained: eos (1 id of 18) ends some samples, not all
    r = collector.Collector(cfg, task, mcfg, model)
    yield r
    r.close()


def _eval(r, path: str, seeds):
    r.cfg.eval.path = path
    got = []

    def gen(prompts, n):
        got.append(r.eval_generate(prompts, n, seeds))
        return got[-1]
    res = evaluate(r.task.heldout, gen, K_SAMPLES, _parity_reward, MAX_NEW, r.task.encode)
    return res, got[0]


def test_servers_and_batched_give_the_same_samples_and_pass_at_k(rollouts):
    seeds = collector.eval_seeds(1234, 3, len(rollouts.task.heldout))
    by_server, s_server = _eval(rollouts, "servers", seeds)
    batched, s_batched = _eval(rollouts, "batched", seeds)
    assert s_server == s_batched
    for key in ("pass@1", "pass@2", "pass@4", "accuracy", "truncation_rate", "per_problem_correct"):
        assert by_server[key] == batched[key], key
    assert 0 < by_server["pass@1"] < 1 and 0 < by_server["truncation_rate"] < 1  # not a degenerate case
    shifted, s_shifted = _eval(rollouts, "batched", [s + 1 for s in seeds])
    assert s_shifted != s_batched  # the seeds drive the draws: equality above is not vacuous


def test_auto_path_and_bad_paths(rollouts):
    seeds = collector.eval_seeds(1234, 0, 2)
    prompts = [rollouts.task.encode(p) for p in rollouts.task.heldout[:2]]
    rollouts.cfg.eval.path = "auto"  # embedded servers: the in-process path
    assert rollouts.eval_generate(prompts, 2, seeds) == collector.sample_batched(
        rollouts.engines[0].model, prompts, 2, MAX_NEW, 1.0, rollouts.task.stop_ids, seeds)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        rollouts.eval_generate(prompts[:1], 2, seeds)
    engines, rollouts.engines = rollouts.engines, []  # as with rollout.urls
    try:
        rollouts.cfg.eval.path = "batched"
        with pytest.raises(ValueError, match="eval.path=servers"):
            rollouts.eval_generate(prompts, 2, seeds)
    finally:
        rollouts.engines = engines
    with pytest.raises(ValueError, match="EvalConfig.path"):
        parse_args(["--eval.path", "rank0"])


def test_eval_seeds_are_per_prompt_and_per_step():
    a, b = collector.eval_seeds(1, 0, 5), collector.eval_seeds(1, 1, 5)
    assert len(set(a)) == 5 and not set(a) & set(b) and a == collector.eval_seeds(1, 0, 5)
    assert all(isinstance(s, int) and 0 <= s < collector.SEED_MOD for s in a + b)


@pytest.mark.parametrize("path", ["servers", "batched"])
def test_eval_refuses_a_server_that_lost_the_pushed_weights(rollouts, path):
    """Issue 39 item 4. Bug caught: eval never compared the servers' weight version with the last verified push,
    so after a server restart it scored the initial weights as the step's. It now checks like the rollout."""
    engine, client = rollouts.engines[0], rollouts.client
    before = (engine.weight_version, client.weight_version)
    client.weight_version = engine.weight_version = "5-launch"   # a verified push of step 5 (StagePusher.tag)
    seeds = collector.eval_seeds(1234, 5, 2)
    prompts = [rollouts.task.encode(p) for p in rollouts.task.heldout[:2]]
    try:
        rollouts.cfg.eval.path = path
        assert len(rollouts.eval_generate(prompts, 1, seeds)) == 2
        engine.weight_version = "0"                      # restarted: its initial weights, its initial version
        with pytest.raises(collector.StaleServerError, match="generated with weight version 0, but version 5-launch"):
            rollouts.eval_generate(prompts, 1, seeds)
    finally:
        engine.weight_version, client.weight_version = before

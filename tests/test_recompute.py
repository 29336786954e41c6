"""Activation recomputation (`ParallelConfig.recompute`, `Transformer.recompute`): every policy -- full, selective,
each sub-block of `config.RECOMPUTE_BLOCKS` alone -- gives the gradients of no recomputation bit for bit, each
sub-block really lowers what a layer keeps for backward, and the planner's activation term predicts the bytes a
whole layer stack keeps after its forward under none, selective and full (counted on the CPU by
`planner.Allocations`, the stand-in for `torch.cuda.memory_allocated`).

Run: pytest tests/test_recompute.py -q
"""
import pytest
import torch

from nanoflash.cli import parse_args
from nanoflash.config import RECOMPUTE_BLOCKS, ParallelConfig, preset, recompute_blocks
from nanoflash.model import Block, Transformer, init_param_, set_recompute
from nanoflash.parallel.planner import Allocations, block_kept_bytes, measure_layer_bytes, plan, stage_act_bytes

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny forwards: latency-bound (conftest.one_thread)
POLICIES = ["full", "selective", *RECOMPUTE_BLOCKS, ",".join(RECOMPUTE_BLOCKS)]
# The planner sums per-layer fits bytes(S) = a S + b pairs(S) measured on one Block at S = 32, 64 and
# extrapolated to the stack's 96 tokens: observed within 0.2% (none, selective) and 1.5% (full: the analytic
# layer inputs leave out each MoE's routing-replay record `last_indices`, [S,K] int64 per layer); the fit
# ignores O(1) terms, so the bound is a few times the worst seen.
STACK_RTOL = 0.05


def tiny_model():
    """tiny in fp32 with non-degenerate sinks, ape, hc bases and router biases (as test_model.tiny_model)."""
    m = Transformer(preset("tiny")).init_weights(0, std=0.2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("_base", "attn_sink", "ape", "gate.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    return m


@pytest.fixture(scope="module")
def model_and_reference():
    m = tiny_model()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    return m, ids, torch.autograd.grad(m(ids).logsumexp(-1).mean(), list(m.parameters()), allow_unused=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_gradients_of_no_recomputation_bit_for_bit(model_and_reference, policy):
    """A recomputed region that recomputes something else than the forward did (a closure over the wrong norm,
    a dropped routing replay, reentrant checkpointing, which drops the gradients of the weights a region closes
    over) changes some gradient; fp32 on the CPU recomputes the same values, so the bar is equality."""
    m, ids, ref = model_and_reference
    m.recompute = policy
    try:
        got = torch.autograd.grad(m(ids).logsumexp(-1).mean(), list(m.parameters()), allow_unused=True)
    finally:
        m.recompute = "none"
    for (name, _), a, b in zip(m.named_parameters(), ref, got):
        assert (a is None and b is None) or torch.equal(a, b), (policy, name)


def _block(ratio_layer: int):
    cfg = preset("tiny")
    block = Block(ratio_layer, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in block.named_parameters():
            init_param_(name, p, g, std=0.2)
    return block, cfg


def test_each_sub_block_lowers_what_a_layer_keeps():
    """A sub-block the flag does not reach (a module without `recompute_blocks`, a misspelt name in the model)
    keeps as much as no recomputation and passes the gradient test: here each must keep strictly less, and
    selective what its three sub-blocks together leave."""
    block, cfg = _block(1)   # tiny's layer 1: C4 (compressor, indexer), score routing
    h = torch.randn(1, 32, cfg.hc_mult, cfg.dim, generator=torch.Generator().manual_seed(4)).requires_grad_()
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        block(h, ids)                        # first calls fill caches (rope frequencies): not activations
    kept = {}
    for policy in ["none", "selective", *RECOMPUTE_BLOCKS]:
        set_recompute(block, policy)
        kept[policy] = block_kept_bytes(block, h, ids)
    for name in RECOMPUTE_BLOCKS:
        assert kept[name] < kept["none"], (name, kept)
    assert kept["selective"] < min(kept[n] for n in recompute_blocks("selective")), kept


def test_planner_predicts_what_a_stack_keeps_after_its_forward():
    """The planner's activation term for one micro-batch (`stage_act_bytes`: per-layer fits summed, the stored
    layer inputs of full recomputation) against the bytes the tiny model's 4 layers really keep after the forward
    of 96 tokens. Catches a planner that prices a sub-block policy with the no-recompute fit (+60% here), counts
    a layer's output as well as the next layer's input, or forgets the checkpointed inputs."""
    cfg, S = preset("tiny"), 96
    m = Transformer(cfg).init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        m(ids[:, :8])                        # rope caches filled before counting
    fits = {p: measure_layer_bytes(cfg, (32, 64), dtype=torch.float32, recompute=p) for p in ("none", "selective")}
    for policy in ("none", "selective", "full"):
        m.recompute = policy
        with Allocations() as mem:
            h0 = m.embed_streams(ids)
            out = m.run_layers(h0, ids)
            del h0
        measured = mem.kept(out)
        predicted, _ = stage_act_bytes(cfg, policy, range(cfg.n_layers), S, fits["none"], fits.get(policy), S, 4)
        assert predicted == pytest.approx(measured, rel=STACK_RTOL), (policy, predicted, measured)
    par = ParallelConfig(micro_batch_tokens=S, recompute="selective")
    with pytest.raises(ValueError, match="needs the activation fit measured under it"):
        plan(cfg, par, fits["none"], dtype=torch.float32)
    row = plan(cfg, par, fits["none"], dtype=torch.float32, recompute_fit=fits["selective"])[0]
    kept, rebuilt = stage_act_bytes(cfg, "selective", range(cfg.n_layers), S, fits["none"], fits["selective"],
                                    None, 4)
    assert row["gpu_terms"]["activations"] == pytest.approx(kept + rebuilt) and 0 < rebuilt < kept


def test_recompute_values():
    """none | full | selective | a list, the former bool (recipes, recorded configs) as full / none, one error
    naming a bad value, and every module holding a sub-block gets the set."""
    assert recompute_blocks("selective") == {"mhc", "norm", "swiglu"}
    assert recompute_blocks("full") == recompute_blocks(True) == recompute_blocks("true") == {"layer"}
    assert recompute_blocks("none") == recompute_blocks(False) == frozenset()
    assert recompute_blocks("mhc, experts") == {"mhc", "experts"}
    for bad, says in (("mhc,bogus", "unknown sub-block.*bogus"), ("full,mhc", "cannot be combined")):
        with pytest.raises(ValueError, match=says):
            ParallelConfig(recompute=bad)
    assert ParallelConfig(recompute=True).recompute == "full"
    assert parse_args(["--parallel.recompute", "attn_q,norm"]).parallel.recompute == "attn_q,norm"
    assert parse_args(["--parallel.recompute", "false"]).parallel.recompute == "none"
    with pytest.raises(ValueError, match="bogus"):
        parse_args(["--parallel.recompute", "bogus"])
    m = Transformer(preset("tiny"))
    m.recompute = "selective"
    holders = [mod for mod in m.modules() if hasattr(mod, "recompute_blocks")]
    assert len(holders) == 5 * (m.cfg.n_layers + m.cfg.n_mtp_layers)   # Block, Attention, MoE, both experts
    assert all(mod.recompute_blocks == {"mhc", "norm", "swiglu"} for mod in holders) and m.recompute == {
        "mhc", "norm", "swiglu"}

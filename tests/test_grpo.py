"""Tests for nanoflash/grpo.py: hand-computed 2-group x 3-sample examples, a per-token loop reference for the
loss (forward and gradient), and properties (zero-mean groups, on-policy loss = -mean A, micro-batch split
invariance for both aggregations, TIS clamp).

Run: `pytest tests/test_grpo.py -q`.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflash.config import GRPOConfig
from nanoflash.rl.metrics import step_metrics
from nanoflash.grpo import (
    Episode, entry_record, episode_advantages, filter_groups, group_advantages, logprob_mismatch_metrics, loss_denominator,
    LossConfig, masked_reduce, pack, policy_loss, prompts_to_request, tis_weights,
)

EXACT = 1e-12  # float64 sums of a handful of terms: only rounding differs
ADV_EPS_TOL = 1e-5  # group_advantages adds eps=1e-6 to std, a relative change of ~2e-6 on these groups
FP32_TOL = 1e-6  # fp32 results vs exact hand values


def _episodes(rewards=((1.0, 0.0, 0.0), (0.0, 2.0, 4.0))):
    """2 groups x 3 samples; prompt lengths 2 or 3, response lengths 1..3."""
    out = []
    for g, rs in enumerate(rewards):
        for i, r in enumerate(rs):
            P, R = 2 + (i % 2), 1 + i
            out.append(Episode(prompt_ids=[10 + g] * P, response_ids=list(range(1, R + 1)),
                               rollout_logprobs=[-0.1 * (j + 1) for j in range(R)], reward=r, group_id=g,
                               finish_reason="length" if i == 2 else "stop"))
    return out


# ------------------------------------------------------------------------------------------ hand examples


def test_group_advantages_hand():
    # group 0: mean 1/3, unbiased std 1/sqrt(3) -> (2/3, -1/3, -1/3) * sqrt(3); group 1: mean 2, std 2.
    a = group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], group_size=3)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(a, torch.tensor([2 / s3, -1 / s3, -1 / s3, -1.0, 0.0, 1.0]), atol=ADV_EPS_TOL, rtol=0)
    # all-equal group -> exactly 0; Dr.GRPO -> centred only
    assert group_advantages([1.0, 1.0, 1.0, 0.0, 2.0, 4.0], 3)[:3].eq(0).all()
    torch.testing.assert_close(group_advantages([0.0, 2.0, 4.0], 3, std_normalize=False), torch.tensor([-2.0, 0, 2]))


def test_episode_advantages_and_pack_hand():
    eps = _episodes()
    adv = episode_advantages(eps, 3)
    assert torch.allclose(adv[3:], torch.tensor([-1.0, 0.0, 1.0]), atol=ADV_EPS_TOL)
    b = pack(eps, adv)
    # sample 4: prompt [11,11,11], response [1,2] -> tokens [11,11,11,1,2]; inputs [11,11,11,1], targets [11,11,1,2]
    S = max(len(e.prompt_ids) + len(e.response_ids) for e in eps) - 1
    assert b.input_ids.shape == (6, S) == b.mask.shape
    assert b.input_ids[4, :4].tolist() == [11, 11, 11, 1] and b.targets[4, :4].tolist() == [11, 11, 1, 2]
    assert b.mask[4].tolist()[:4] == [0, 0, 1, 1] and b.mask[4, 4:].eq(0).all()
    assert b.rollout_logprobs[4, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert b.advantages[4].eq(0).all() and b.advantages[5, 1:4].eq(adv[5]).all()
    assert b.mask.sum(1).tolist() == [1, 2, 3, 1, 2, 3]
    assert b.cu_seqlens.tolist() == [0, 2, 6, 10, 12, 16, 20]  # P+R-1 = 2, 4, 4 per group
    # split keeps rows and rebases cu_seqlens
    m = b.split(4)
    assert [len(x) for x in m] == [4, 2] and m[1].cu_seqlens.tolist() == [0, 4, 8]
    assert torch.equal(m[1].targets, b.targets[4:])


def test_pack_routed_experts():
    eps = _episodes()[:2]
    for e in eps:
        e.routed_experts = torch.ones(len(e.prompt_ids) + len(e.response_ids) - 1, 2, 3, dtype=torch.int32)
    b = pack(eps, [0.0, 0.0])
    assert b.routed_experts.shape == (2, b.input_ids.shape[1], 2, 3)
    assert b.routed_experts.sum((2, 3)).tolist() == (b.cu_seqlens.diff()[:, None] > torch.arange(4)).mul(6).tolist()


def test_pack_indexer_records_as_entry_plus_one_and_back():
    """Indexer replay records: the engine's entries (-1 = none) stored entry + 1 in int16 (int32 past 2^15
    entries), zero-padded past each row (0 = none, so padding keeps nothing), and back to the entries as
    `run_layers(indexed=)` reads them. Bugs
    caught: padding with 0 read as entry 0; a wide record cut to the first episode's int16."""
    eps = _episodes()[:2]
    kept = []
    for i, e in enumerate(eps):
        T = len(e.prompt_ids) + len(e.response_ids) - 1
        k = torch.arange(T * 2 * 3).view(T, 2, 3) % 5 - 1                      # entries -1..3
        if i == 1:
            k[0, 0, 0] = 2 ** 15                                                # a 131K-token context's entry
        kept.append(k)
        e.indexer_topk = entry_record(k)
    assert eps[0].indexer_topk.dtype == torch.int16 and eps[1].indexer_topk.dtype == torch.int32
    b = pack(eps, [0.0, 0.0])
    back = b.indexer_topk.long() - 1                                          # [B,S,2,3], as run_layers reads it
    assert b.indexer_topk.dtype == torch.int32
    for r, k in enumerate(kept):
        assert torch.equal(back[r, :len(k)], k) and (back[r, len(k):] == -1).all()
    with pytest.raises(ValueError, match=r"indexer_topk shape \(3, 2, 3\), expected \[4, n_c4_layers"):
        Episode([1, 2], [3, 4, 5], [0.0] * 3, 1.0, 0, indexer_topk=torch.zeros(3, 2, 3, dtype=torch.int16))


def _hand_loss_inputs():
    """6 samples x 2 tokens with ratios chosen to hit every branch of the clipped surrogate (see test)."""
    ratio = torch.tensor([[1.5, 1.0], [0.5, 1.1], [2.0, 7.0], [0.5, 1.0], [3.0, 0.1], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 0]], dtype=torch.float64)
    A = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 1.0], dtype=torch.float64)[:, None] * torch.ones(6, 2)
    old = torch.full((6, 2), -1.0, dtype=torch.float64)
    return (old + ratio.log()).requires_grad_(), old, A.double(), mask


def test_policy_loss_hand():
    # per-token losses max(-rho A, -clip(rho, 0.8, 1.28) A):
    #  s0 A=+1: rho 1.5 -> -1.28 (clipped), rho 1 -> -1            sample mean -1.14
    #  s1 A=-1: rho 0.5 -> 0.8 (clipped),   rho 1.1 -> 1.1          sample mean  0.95
    #  s2 A=-1: rho 2 -> 2 (unclipped branch is larger), t1 masked  sample mean  2.0
    #  s3 A=+1: rho 0.5 -> -0.5 (unclipped), rho 1 -> -1            sample mean -0.75
    #  s4 A=0 -> 0, 0;  s5 fully masked -> 0, still one of the 6 samples
    lp, old, A, mask = _hand_loss_inputs()
    loss, m = policy_loss(lp, old, A, mask)
    assert loss.item() == pytest.approx((-1.14 + 0.95 + 2.0 - 0.75) / 6, abs=FP32_TOL)
    assert m["pg_clipfrac"].item() == pytest.approx((0.5 + 0.5) / 6, abs=FP32_TOL)
    loss_t, m_t = policy_loss(lp, old, A, mask, LossConfig(aggregation="token-mean"))
    assert loss_t.item() == pytest.approx((-1.28 - 1 + 0.8 + 1.1 + 2.0 - 0.5 - 1) / 9, abs=FP32_TOL)
    assert m_t["pg_clipfrac"].item() == pytest.approx(2 / 9, abs=FP32_TOL)
    # gradient d loss / d logp = -rho A / (n_b B) on unclipped tokens, 0 on clipped ones (seq-mean-token-mean)
    loss.backward()
    g = torch.tensor([[0, -1 / 2], [0, 1.1 / 2], [2.0, 0], [-0.5 / 2, -1 / 2], [0, 0], [0, 0]]) / 6
    torch.testing.assert_close(lp.grad, g.double(), atol=FP32_TOL, rtol=0)


def _one_token(rho, adv, **kw):
    """policy_loss of a single token with ratio rho and advantage adv -> (loss, d loss / d logp)."""
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    lp = (old + math.log(rho)).requires_grad_()
    loss, _ = policy_loss(lp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), LossConfig(**kw))
    (g,) = torch.autograd.grad(loss, lp)
    return loss.item(), g.item()


@pytest.mark.parametrize("rho,adv,loss,grad", [
    # each bound on its own token, so swapping eps_low / eps_high cannot cancel (bounds 0.8 and 1.28;
    # swapped they would be 0.72 and 1.2, the values in brackets)
    (1.5, +1.0, -1.28, 0.0),      # above 1 + eps_high: clipped            [swapped: -1.2]
    (1.25, +1.0, -1.25, -1.25),   # inside: d(-rho A)/d logp = -rho A      [swapped: clipped at 1.2, grad 0]
    (0.5, -1.0, 0.8, 0.0),        # below 1 - eps_low, A < 0: clipped      [swapped: 0.72]
    (0.75, -1.0, 0.8, 0.0),       # 0.75 < 0.8: still clipped              [swapped: inside, 0.75, grad 0.75]
    (0.5, +1.0, -0.5, -0.5),      # A > 0 below the band: the unclipped branch is the max, never clipped
    (2.0, -1.0, 2.0, 2.0),        # A < 0 above the band: likewise
])
def test_clip_bounds_each_side_hand(rho, adv, loss, grad):
    got_loss, got_grad = _one_token(rho, adv)
    assert got_loss == pytest.approx(loss, abs=FP32_TOL) and got_grad == pytest.approx(grad, abs=FP32_TOL)


@pytest.mark.parametrize("rho,adv,loss,grad", [
    # dual clip, clip_c = 3: l = min(PPO l, -3 A) where A < 0   [min and max swapped, or no A < 0 guard]
    (5.0, -1.0, 3.0, 0.0),        # PPO l = 5 -> capped at 3, no gradient  [swapped: 5]
    (2.0, -1.0, 2.0, 2.0),        # PPO l = 2 < 3 -> unchanged             [swapped: 3, grad 0]
    (5.0, +1.0, -1.28, 0.0),      # A > 0: untouched                       [no guard: min(-1.28, -3) = -3]
])
def test_dual_clip_hand(rho, adv, loss, grad):
    got_loss, got_grad = _one_token(rho, adv, clip_c=3.0)
    assert got_loss == pytest.approx(loss, abs=FP32_TOL) and got_grad == pytest.approx(grad, abs=FP32_TOL)


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        _one_token(2.0, -1.0, clip_c=1.0)


def test_tis_and_mismatch_hand():
    old = torch.tensor([[-1.0, -2.0]])
    roll = torch.tensor([[-1.0 - math.log(3.0), -2.0]])  # tis = 3 (clamped to 2), 1
    w, stats = tis_weights(old, roll, 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0]]))
    assert stats["tis_clipfrac"].tolist() == [[1.0, 0.0]] and stats["tis_abs"][0, 0].item() == pytest.approx(2.0)
    mask = torch.ones(1, 2)
    mm = logprob_mismatch_metrics(old, roll, mask)
    d = math.log(3.0)  # t - r on token 0, 0 on token 1
    assert mm["train_rollout_logprob_abs_diff"].item() == pytest.approx(d / 2, abs=FP32_TOL)
    assert mm["train_rollout_kl"].item() == pytest.approx((math.exp(d) - 1 - d) / 2, abs=FP32_TOL)
    assert mm["train_rollout_kl_k1"].item() == pytest.approx(-d / 2, abs=FP32_TOL)
    # inside the loss: A=1, on-policy ratio 1 -> per-token -w; sample mean = -(2 + 1)/2
    loss, m = policy_loss(old.clone(), old, torch.ones(1, 2), mask, rollout_logp=roll)
    assert loss.item() == pytest.approx(-1.5) and m["tis"].item() == pytest.approx(2.0)
    loss_off, m_off = policy_loss(old.clone(), old, torch.ones(1, 2), mask, LossConfig(tis_cap=None), rollout_logp=roll)
    assert loss_off.item() == pytest.approx(-1.0) and m_off["tis_clipfrac"].item() == 0.0


def test_filter_groups_and_step_metrics_hand():
    eps = _episodes(((1.0, 1.0, 1.0), (0.0, 2.0, 4.0)))
    kept = filter_groups(eps, 3)
    assert [e.group_id for e in kept] == [1, 1, 1]
    assert filter_groups(_episodes(((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))), 3) == []
    sm = step_metrics(eps, group_size=3)
    assert sm["reward_mean"] == pytest.approx(9 / 6) and sm["zero_std_group_frac"] == pytest.approx(0.5)
    assert sm["response_len_mean"] == pytest.approx(2.0) and sm["response_len_max"] == 3.0
    assert sm["truncated_frac"] == pytest.approx(2 / 6) and sm["prompt_len_mean"] == pytest.approx(14 / 6)
    assert sm["rollout_logprob_mean"] == pytest.approx(-(0.1 + 0.3 + 0.6) * 2 / 12)


def test_prompts_to_request_hand():
    assert prompts_to_request(0, 32, 0, 512) == 512
    assert prompts_to_request(30, 32, 0, 4) == 4  # need 2 more -> one chunk
    assert prompts_to_request(0, 32, 20, 5) == 15  # 12 missing -> 3 chunks of 5
    assert prompts_to_request(10, 32, 22, 4) == 0 and prompts_to_request(32, 32, 0, 4) == 0


# ------------------------------------------------------------------------------------------ naive reference


def naive_policy_loss(lp, old, A, mask, roll, ref, ent, clip_low, clip_high, tis_clip, kl_coef, ent_coef, agg):
    """Per-token python loop over scalars (autograd through indexing) of the same GRPO loss."""
    B, S = lp.shape
    total, n_tokens, n_samples = 0.0, 0, B
    for b in range(B):
        row, n = 0.0, 0
        for t in range(S):
            if mask[b, t] == 0:
                continue
            rho = torch.exp(lp[b, t] - old[b, t])
            rho_c = rho.clamp(1 - clip_low, 1 + clip_high)
            tok = -rho * A[b, t] if -rho * A[b, t] >= -rho_c * A[b, t] else -rho_c * A[b, t]
            tok = tok * min(math.exp(old[b, t] - roll[b, t]), tis_clip)
            d = lp[b, t] - ref[b, t]
            tok = tok + kl_coef * (torch.exp(-d) - 1 + d) - ent_coef * ent[b, t]
            row, n = row + tok, n + 1
        total = total + (row / max(n, 1) if agg == "seq-mean-token-mean" else row)
        n_tokens += n
    return total / (n_samples if agg == "seq-mean-token-mean" else n_tokens)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_policy_loss_vs_naive_loop(agg):
    g = torch.Generator().manual_seed(0)
    B, S = 6, 5
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    lp = (old + 0.4 * torch.randn(B, S, generator=g, dtype=torch.float64)).requires_grad_()
    roll = old + torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ent = torch.rand(B, S, generator=g, dtype=torch.float64)
    A = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S)
    mask = (torch.rand(B, S, generator=g) < 0.7).double()
    mask[-1] = 0  # one fully masked sample
    kw = dict(clip_low=0.2, clip_high=0.28, tis_clip=2.0, kl_coef=0.1, ent_coef=0.01)
    want = naive_policy_loss(lp, old, A, mask, roll, ref, ent, agg=agg, **kw)
    (g_want,) = torch.autograd.grad(want, lp)
    lc = LossConfig(kl_coef=0.1, kl_type="k3", entropy_coef=0.01, aggregation=agg)
    got, m = policy_loss(lp.double(), old, A, mask, lc, rollout_logp=roll, ref_logp=ref, entropy=ent)
    (g_got,) = torch.autograd.grad(got, lp)
    # policy_loss computes in fp32 (as the trainer's logprobs are fp32); the loop runs in fp64
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-5)
    assert 0 < m["tis_clipfrac"] < 1 and 0 < m["pg_clipfrac"] < 1, "example must exercise both clamps"


# ------------------------------------------------------------------------------------------ properties


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_group_advantages_property(n_groups, group_size, data):
    r = data.draw(st.lists(st.floats(-5, 5), min_size=n_groups * group_size, max_size=n_groups * group_size))
    a = group_advantages(r, group_size).view(n_groups, group_size)
    assert a.mean(1).abs().max() < 1e-5, f"group means {a.mean(1)}"
    if group_size == 1:
        return
    std = torch.tensor(r).view(n_groups, group_size).std(1)
    for i in range(n_groups):
        if std[i] > 1e-2:  # well-separated rewards: normalised to unit (unbiased) std
            assert abs(a[i].std().item() - 1) < 1e-3, f"group {i} std {a[i].std()}"


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_on_policy_loss_is_minus_mean_advantage_property(agg):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 4, generator=g)
    A = group_advantages(torch.rand(6, generator=g), 3)[:, None].expand(6, 4)
    mask = torch.ones(6, 4)
    loss, m = policy_loss(old.clone(), old, A, mask, LossConfig(aggregation=agg))
    assert loss.item() == pytest.approx(-A[:, 0].mean().item(), abs=FP32_TOL)
    assert m["pg_clipfrac"] == 0 and m["ppo_kl"] == 0 and m["ess_ratio"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_micro_batch_split_matches_full_batch_property(agg):
    g = torch.Generator().manual_seed(2)
    eps = []
    for i in range(8):
        P, R = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        eps.append(Episode([1] * P, [2] * R, (-torch.rand(R, generator=g)).tolist(), float(i % 3), i // 4))
    batch = pack(eps, episode_advantages(eps, 4))
    logp = (batch.rollout_logprobs.double() + 0.3 * torch.randn(batch.mask.shape, generator=g)).requires_grad_()
    lc = LossConfig(aggregation=agg)
    full, m_full = policy_loss(logp, batch.rollout_logprobs + 0.1, batch.advantages, batch.mask, lc,
                               rollout_logp=batch.rollout_logprobs)
    (g_full,) = torch.autograd.grad(full, logp)
    micro = batch.split(3)
    denom = sum(loss_denominator(mb.mask, agg) for mb in micro)  # the trainer's global denominator
    total, g_micro, m_sum, row = 0.0, [], {}, 0
    for mb in micro:
        lp = logp[row:row + len(mb)].detach().requires_grad_()
        row += len(mb)
        loss, m = policy_loss(lp, mb.rollout_logprobs + 0.1, mb.advantages, mb.mask, lc, denom=denom,
                              rollout_logp=mb.rollout_logprobs)
        g_micro.append(torch.autograd.grad(loss, lp)[0])
        total += loss.item()
        m_sum = {k: m_sum.get(k, 0.0) + v.item() for k, v in m.items()}
    assert total == pytest.approx(full.item(), abs=FP32_TOL)
    torch.testing.assert_close(torch.cat(g_micro), g_full, atol=1e-7, rtol=1e-6)
    assert m_sum == pytest.approx({k: v.item() for k, v in m_full.items()}, abs=FP32_TOL)


def test_tis_clamp_property():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=g)
    roll = old + 2 * torch.randn(4, 6, generator=g)
    for clip in (0.5, 1.0, 2.0, 5.0):
        w, stats = tis_weights(old, roll, clip)
        assert w.max() <= clip and w.min() >= 0, f"weights {w.min()}..{w.max()} outside [0, {clip}]"
        below = stats["tis"] < clip
        assert torch.equal(w[below], stats["tis"][below]) and (w[~below] == clip).all()
        assert stats["tis_clipfrac"].sum() == (~below).sum()
    # the weight carries no gradient: the surrogate's gradient is only scaled by it
    lp = old.clone().requires_grad_()
    lc = LossConfig(tis_cap=2.0, aggregation="token-mean")
    loss, _ = policy_loss(lp, old, torch.ones(4, 6), torch.ones(4, 6), lc, rollout_logp=roll)
    loss.backward()
    w, _ = tis_weights(old, roll, 2.0)
    torch.testing.assert_close(lp.grad, -w / 24)


def test_masked_reduce_ignores_off_mask_nan():
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_reduce(x, mask).item() == pytest.approx((1 + 4) / 2)
    assert masked_reduce(x, mask, "token-mean").item() == pytest.approx(9 / 3)


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_errors():
    with pytest.raises(ValueError, match="2 rollout logprobs for 3"):
        Episode([1], [1, 2, 3], [0.0, 0.0], 1.0, 0)
    with pytest.raises(ValueError, match="finish_reason 'eos'"):
        Episode([1], [1], [0.0], 1.0, 0, finish_reason="eos")
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0] * 6, 4)
    eps = _episodes()
    with pytest.raises(ValueError, match="contiguous"):
        episode_advantages(eps[1:] + eps[:1], 3)
    with pytest.raises(ValueError, match="group_size=2"):
        filter_groups(eps, 2)
    with pytest.raises(ValueError, match="'mean'"):
        masked_reduce(torch.ones(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="one advantage each"):
        pack(eps, [0.0])
    with pytest.raises(ValueError, match="agg"):
        GRPOConfig(aggregation="mean")


def test_group_advantages_2d_api():
    """The documented form: rewards [groups, samples] -> advantages of the same shape; a 1-sample group gets 0."""
    A = group_advantages([[1.0, 0.0, 0.0], [0.0, 2.0, 4.0]], eps=0.0)
    assert A.shape == (2, 3)
    assert A[1].tolist() == pytest.approx([-1.0, 0.0, 1.0])
    assert torch.equal(A.flatten(), group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], 3, eps=0.0))
    assert group_advantages([[5.0], [3.0]]).tolist() == [[0.0], [0.0]]


def test_loss_config_of_a_run_turns_tis_on_only_with_use_tis():
    """The bug: a run's GRPOConfig mapped onto the loss with TIS on although `use_tis` is off (or the clips lost)."""
    assert LossConfig.of(GRPOConfig()) == LossConfig(tis_cap=None)
    gc = GRPOConfig(clip_low=0.1, clip_high=0.3, clip_c=3.0, use_tis=True, tis_cap=1.5, aggregation="token-mean")
    assert LossConfig.of(gc) == LossConfig(0.1, 0.3, 3.0, 1.5, aggregation="token-mean")

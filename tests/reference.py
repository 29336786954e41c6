"""Deliberately naive references for every block of nanoflash/model.py.

Each function recomputes one block from the notes (`docs/v4_notes.md`) with explicit loops,
complex-number RoPE and dense masks, reading the parameters off the module under test. Nothing here is shared
with model.py except the config, so a bug has to be made twice to go unnoticed.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rmsnorm(x, w, eps):
    xf = x.double()
    return (w.double() * xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inv_freq(rope_dim, base, factor=1.0, orig=0, beta_fast=32, beta_slow=1):
    freqs = [base ** (-2 * i / rope_dim) for i in range(rope_dim // 2)]
    if orig <= 0:
        return torch.tensor(freqs, dtype=torch.float64)
    cd = lambda n: rope_dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(cd(beta_fast)), 0), min(math.ceil(cd(beta_slow)), rope_dim - 1)
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def layer_inv_freq(cfg, compressed):
    if compressed:
        return inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len,
                        cfg.beta_fast, cfg.beta_slow)
    return inv_freq(cfg.rope_head_dim, cfg.rope_theta)


def rope(x, positions, freqs, inverse=False):
    """Complex-number rotation of interleaved pairs of the last 2*len(freqs) dims. x [..., S, (H,) d]."""
    r = 2 * len(freqs)
    out = x.clone().double()
    z = torch.view_as_complex(out[..., -r:].contiguous().view(*out.shape[:-1], r // 2, 2))
    ang = positions.double()[:, None] * freqs[None]
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)              # [S,r/2]
    if x.dim() == 4:
        rot = rot[:, None]
    out[..., -r:] = torch.view_as_real(z * rot).flatten(-2)
    return out.to(x.dtype)


def compressor(comp, x, cfg):
    """Per-window loop over complete windows (v4_notes §2.3.5). -> [B, S//m, d]"""
    m, d = comp.ratio, comp.head_dim
    B, S, _ = x.shape
    kv = x.double() @ comp.wkv.weight.double().T
    sc = x.double() @ comp.wgate.weight.double().T
    ape = comp.ape.double()
    out = []
    for w in range(S // m):
        slots_kv, slots_sc = [], []
        for r in range(m):
            t = w * m + r
            if comp.overlap:
                if w > 0:
                    tp = (w - 1) * m + r
                    slots_kv.append(kv[:, tp, :d]); slots_sc.append(sc[:, tp, :d] + ape[r, :d])
                slots_kv.append(kv[:, t, d:]); slots_sc.append(sc[:, t, d:] + ape[r, d:])
            else:
                slots_kv.append(kv[:, t]); slots_sc.append(sc[:, t] + ape[r])
        p = torch.softmax(torch.stack(slots_sc, 1), dim=1)                           # per channel
        out.append((p * torch.stack(slots_kv, 1)).sum(1))
    c = torch.stack(out, 1) if out else kv.new_zeros(B, 0, d)
    c = rmsnorm(c, comp.norm.weight, cfg.norm_eps)
    pos = torch.arange(c.shape[1]) * m
    return rope(c, pos, layer_inv_freq(cfg, True))


def indexer_scores(idx, x, qr, cfg):
    """Brute-force indexer scores of every query over every visible entry (-inf elsewhere). -> [B,S,C]"""
    B, S, _ = x.shape
    keys = compressor(idx.compressor, x, cfg)                                        # [B,C,dI]
    q = (qr.double() @ idx.wq_b.weight.double().T).view(B, S, cfg.index_n_heads, cfg.index_head_dim)
    q = rope(q, torch.arange(S), layer_inv_freq(cfg, True))
    w = (x.double() @ idx.weights_proj.weight.double().T) / math.sqrt(cfg.index_head_dim * cfg.index_n_heads)
    C = keys.shape[1]
    scores = torch.full((B, S, C), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            for u in range(min(C, (t + 1) // 4)):
                scores[b, t, u] = sum(torch.relu(q[b, t, h] @ keys[b, u]) * w[b, t, h]
                                      for h in range(cfg.index_n_heads))
    return scores


def attention(attn, x, cfg, keep=None):
    """Dense masked attention over [S raw keys | C compressed entries] with an explicit sink column.
    C4 layers use the given indexer selection `keep` [B,S,C] (validated separately against indexer_scores)
    or, when None, every visible entry (index_topk >= C)."""
    B, S, _ = x.shape
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    pos = torch.arange(S)
    freqs = layer_inv_freq(cfg, attn.ratio > 0)
    qr = rmsnorm(x.double() @ attn.wq_a.weight.double().T, attn.q_norm.weight, cfg.norm_eps)
    q = (qr @ attn.wq_b.weight.double().T).view(B, S, H, Dh)
    q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + cfg.norm_eps)
    q = rope(q, pos, freqs)
    kv = rope(rmsnorm(x.double() @ attn.wkv.weight.double().T, attn.kv_norm.weight, cfg.norm_eps), pos, freqs)
    t, j = pos[:, None], pos[None, :]
    mask = ((t - j >= 0) & (t - j < W))[None].expand(B, S, S)                      # window incl. self
    keys = kv
    if attn.ratio:
        comp = compressor(attn.compressor, x, cfg)
        if attn.ratio == 4 and keep is not None:
            cmask = keep
        else:
            attn.ratio == 4 and assert_all_kept(cfg, comp.shape[1])
            cmask = (torch.arange(comp.shape[1])[None, :] < (pos[:, None] + 1) // attn.ratio)[None].expand(B, -1, -1)
        keys, mask = torch.cat([kv, comp], 1), torch.cat([mask, cmask], -1)
    o = torch.zeros(B, S, H, Dh, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            logits = (q[b, :, h] @ keys[b].T) / math.sqrt(Dh)                        # [S,L]
            logits = logits.masked_fill(~mask[b], float("-inf"))
            sink = attn.attn_sink[h].double().expand(S, 1)
            p = torch.softmax(torch.cat([logits, sink], 1), 1)[:, :-1]
            o[b, :, h] = p @ keys[b]
    o = rope(o, pos, freqs, inverse=True)
    G, r = cfg.o_groups, cfg.o_lora_rank
    wa = attn.wo_a.weight.double().view(G, r, -1)
    z = torch.stack([o.flatten(2)[..., g * wa.shape[2]:(g + 1) * wa.shape[2]] @ wa[g].T for g in range(G)], 2)
    return (z.flatten(2) @ attn.wo_b.weight.double().T).to(x.dtype)


def assert_all_kept(cfg, n_entries):
    assert cfg.index_topk >= n_entries, "pass the indexer's selection when index_topk < #entries"


def gate(g, x, ids, cfg):
    s = torch.sqrt(F.softplus(x.double() @ g.weight.double().T))
    if g.hash:
        idx = g.tid2eid[ids]
    else:
        idx = torch.stack([torch.argsort(-(s[n] + g.bias.double()))[:cfg.n_activated_experts] for n in range(len(s))])
    w = torch.stack([s[n, idx[n]] / s[n, idx[n]].sum() for n in range(len(s))]) * cfg.route_scale
    return w, idx


def expert(e, x, rw=None, limit=0.0):
    g, u = x.double() @ e.w1.weight.double().T, x.double() @ e.w3.weight.double().T
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    a = F.silu(g) * u
    if rw is not None:
        a = a * rw
    return a @ e.w2.weight.double().T


def moe(mod, x, ids, cfg):
    """Per-token loop over the chosen experts."""
    xf, idf = x.flatten(0, 1), ids.flatten()
    w, idx = gate(mod.gate, xf, idf, cfg)
    y = expert(mod.shared_experts, xf)
    sd = mod.experts.state_dict(keep_vars=True)  # official per-expert names; differentiable views of the stacks
    routed = lambda e: SimpleNamespace(**{m: SimpleNamespace(weight=sd[f"{e}.{m}.weight"]) for m in ("w1", "w2", "w3")})
    rows = []
    for n in range(len(xf)):
        acc = torch.zeros(xf.shape[1], dtype=torch.float64)
        for k in range(idx.shape[1]):
            acc = acc + expert(routed(int(idx[n, k])), xf[n:n + 1], w[n, k], cfg.swiglu_limit)[0]
        rows.append(acc)
    return (torch.stack(rows) + y).view_as(x).to(x.dtype)


def sinkhorn(mixes, scale, base, M, iters, eps):
    """Loop Sinkhorn on python floats, one token at a time. mixes [N,(2+M)M] -> pre, post, comb"""
    pres, posts, combs = [], [], []
    for row in mixes.double().tolist():
        sig = lambda v: 1 / (1 + math.exp(-v))
        pres.append([sig(row[j] * scale[0] + base[j]) + eps for j in range(M)])
        posts.append([2 * sig(row[M + j] * scale[1] + base[M + j]) for j in range(M)])
        c = [[row[2 * M + M * j + k] * scale[2] + base[2 * M + M * j + k] for k in range(M)] for j in range(M)]
        c = [[math.exp(v - max(r)) / sum(math.exp(u - max(r)) for u in r) + eps for v in r] for r in c]
        colnorm = lambda c: [[c[j][k] / (sum(c[i][k] for i in range(M)) + eps) for k in range(M)] for j in range(M)]
        c = colnorm(c)
        for _ in range(iters - 1):
            c = [[v / (sum(r) + eps) for v in r] for r in c]
            c = colnorm(c)
        combs.append(c)
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    return t(pres), t(posts), t(combs)


def hc_post(x, res, post, comb):
    """out[k] = post[k] x + sum_j comb[j][k] res[j], as explicit loops over streams."""
    M = res.shape[2]
    outs = []
    for k in range(M):
        acc = post[..., k, None].double() * x.double()
        for j in range(M):
            acc = acc + comb[..., j, k, None].double() * res[..., j, :].double()
        outs.append(acc)
    return torch.stack(outs, 2)

"""AdamW with fp32 master weights, optional host-memory offload of the optimizer state, and the RL freeze list.

Update (decoupled weight decay, Loshchilov & Hutter; the same arithmetic as `torch.optim.AdamW`), per
parameter with fp32 master copy w, gradient g (cast to fp32), step t:

    w <- w * (1 - lr * wd)                               (wd only on matrices: ndim >= 2)
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
    param <- w cast to the model dtype (bf16 in real runs)

State per trainable parameter: master w (only when the model is not fp32, or when offloading), m, v: 12 bytes
per parameter in fp32. With `offload=True` all three live in host memory (pinned when CUDA is present); the
gradient is copied to the host, the step runs on the CPU, and the new weight is copied back. That trades
PCIe traffic and CPU time for ~12 bytes/param of GPU memory (the reference deployment does this).

What trains in V4 RL (Miles' recipe): everything except the router gate weight and bias (`ffn.gate.*`), the
lightning indexer (`attn.indexer.*`, which gets no gradient through its top-k anyway) and the MTP block
(unless `train_mtp`). `trainable_parameters` switches `requires_grad` off for those, so they get no gradient,
no optimizer state and no weight decay.

How this differs from production: no ZeRO sharding of the state over DP, no fused/foreach kernel, no
overlap of the host step with the next forward. Tests: `pytest tests/test_parallel_optim.py -q`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

FROZEN_KEYS = (".ffn.gate.weight", ".ffn.gate.bias", ".attn.indexer.")  # frozen in V4 RL (Miles)
MTP_PREFIX = "mtp."


def is_frozen(name: str, train_mtp: bool = False) -> bool:
    return any(k in name for k in FROZEN_KEYS) or (not train_mtp and name.startswith(MTP_PREFIX))


def trainable_parameters(model: nn.Module, train_mtp: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Freeze (requires_grad=False) the router, indexer and, unless asked, MTP; return the rest by name."""
    out = []
    for name, p in model.named_parameters():
        frozen = is_frozen(name, train_mtp)
        p.requires_grad_(not frozen)
        if not frozen:
            out.append((name, p))
    return out


class AdamW:
    """AdamW over named parameters with fp32 master weights (see module docstring for the equations).

    Shapes: state tensors have their parameter's shape, fp32.
    """

    def __init__(self, named_params, lr: float = 1e-6, weight_decay: float = 0.1, betas=(0.9, 0.98),
                 eps: float = 1e-8, offload: bool = False):
        self.lr, self.weight_decay, self.betas, self.eps, self.offload = lr, weight_decay, tuple(betas), eps, offload
        self.params = dict(named_params)
        self.step_count = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params.items():
            dev = torch.device("cpu") if offload else p.device
            pin = offload and torch.cuda.is_available()
            st = {"exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=dev, pin_memory=pin),
                  "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=dev, pin_memory=pin)}
            if offload or p.dtype != torch.float32:
                st["master"] = torch.empty(p.shape, dtype=torch.float32, device=dev, pin_memory=pin)
                st["master"].copy_(p.detach())
            self.state[name] = st

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update. Offloaded: all gradients go to the host first (async copies, one sync), the host does
        the math, then the new weights go back (async copies, one sync before the master is touched again)."""
        self.step_count += 1
        live = [(n, p) for n, p in self.params.items() if p.grad is not None]
        on_gpu = any(p.is_cuda for _, p in live)
        grads = {n: p.grad.float().to(self.state[n]["exp_avg"].device, non_blocking=on_gpu) for n, p in live}
        if self.offload and on_gpu:
            torch.cuda.synchronize()  # the host must not read a gradient still in flight
        for name, p in live:
            self._update(name, p, grads[name])
        if self.offload and on_gpu:
            torch.cuda.synchronize()  # next step's host math must not race the weight upload

    def _update(self, name: str, p: torch.Tensor, g: torch.Tensor) -> None:
        st, (b1, b2) = self.state[name], self.betas
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        w = st.get("master", p)
        if self.weight_decay and p.ndim >= 2:
            w.mul_(1 - self.lr * self.weight_decay)
        st["exp_avg"].lerp_(g, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(self.eps)
        w.addcdiv_(st["exp_avg"], denom, value=-self.lr / bc1)
        if w is not p:
            p.copy_(w, non_blocking=p.is_cuda)

    # ------------------------------------------------------------------ checkpoint I/O (flat, by FQN)
    def state_dict(self) -> dict:
        """{"step": int, "<fqn>.<exp_avg|exp_avg_sq|master>": tensor} - flat, so DCP can reshard it by name."""
        sd = {"step": self.step_count}
        for name, st in self.state.items():
            for k, v in st.items():
                sd[f"{name}.{k}"] = v
        return sd

    def load_state_dict(self, sd: dict) -> None:
        missing = [f"{n}.{k}" for n, st in self.state.items() for k in st if f"{n}.{k}" not in sd]
        if missing or "step" not in sd:
            raise ValueError(f"optimizer state lacks {missing[:5]}{'...' if len(missing) > 5 else ''}"
                             f"{' and step' if 'step' not in sd else ''}")
        self.step_count = int(sd["step"])
        for name, st in self.state.items():
            for k, v in st.items():
                v.copy_(sd[f"{name}.{k}"])

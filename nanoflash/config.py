"""Configuration: one module of plain dataclasses.

`ModelConfig` uses the field names of DeepSeek's official `inference/config.json` (`ModelArgs`), so
`ModelConfig(**json.load(open("inference/config.json")))` works as is, and `ModelConfig.from_hf_config(path)`
reads the Hugging Face `config.json` through the key table of v4_notes §1.2:

    hidden_size -> dim, moe_intermediate_size -> moe_inter_dim, num_hidden_layers -> n_layers, ...

Presets (`PRESETS`):
    flash  the published DeepSeek-V4-Flash (284B MoE, 43 layers + 1 MTP layer).
    small  the real per-head geometry (64 heads x 512, rope 64, indexer 64 x 128, hc 4, window 128, every FP8
           weight dim a multiple of 128 so real SGLang can serve it) with 8 layers and 16 experts: ~1.9B params.
    h200   `small` cut to 4 layers (sliding, C4, C128, C4), 1 hash layer, no MTP: ~1.2B params (issue 20's run).
    tiny   a few hundred thousand parameters for CPU tests: sliding-only, C4 and "C128" (ratio 8) layers,
           hash and score routing, MTP.

Tests: `pytest tests/test_export.py` (from_hf_config), `tests/test_model.py` (preset parameter counts),
`tests/test_train_cli.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from nanoflash.run_config import (  # noqa: F401  (the run's sections: one config tree)
    EvalConfig, GRPOConfig, OptimConfig, ParallelConfig, RolloutConfig, RunConfig, TrainConfig)


@dataclass
class ModelConfig:
    """DeepSeek-V4 hyper-parameters, named as in the official `inference/config.json`."""

    vocab_size: int = 129280          # tokenizer vocabulary
    dim: int = 4096                   # hidden size D
    moe_inter_dim: int = 2048         # routed and shared expert intermediate size
    n_layers: int = 43                # backbone blocks
    n_hash_layers: int = 3            # the first n layers route by the tid2eid table
    n_mtp_layers: int = 1             # multi-token-prediction blocks (layer ids n_layers, n_layers+1, ...)
    n_heads: int = 64                 # query heads (one shared K=V head)
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6      # top-k
    score_func: str = "sqrtsoftplus"  # router scores: sqrtsoftplus | sigmoid | softmax
    route_scale: float = 1.5          # routed weights are renormalised then multiplied by this
    swiglu_limit: float = 10.0        # clamp of routed experts' gate/up (0 disables)
    q_lora_rank: int = 1024           # rank of the q low-rank path (wq_a -> q_norm -> wq_b)
    head_dim: int = 512               # q and kv head dim, layout [nope | rope]
    rope_head_dim: int = 64           # rotary dims: the last rope_head_dim of each head
    norm_eps: float = 1e-6            # RMSNorm eps (also the mHC RMS eps)
    o_groups: int = 8                 # grouped output projection: groups
    o_lora_rank: int = 1024           # grouped output projection: rank per group
    window_size: int = 128            # sliding window, self included
    compress_ratios: tuple = (0, 0) + (4, 128) * 20 + (4, 0)  # one per layer, then one per MTP layer
    compress_rope_theta: float = 160000.0  # rope base of compressed (C4 / C128) layers, with YaRN
    original_seq_len: int = 65536     # YaRN original context (compressed layers only)
    rope_theta: float = 10000.0       # rope base of sliding-only layers, no YaRN
    rope_factor: float = 16.0         # YaRN factor
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64           # lightning indexer heads
    index_head_dim: int = 128         # lightning indexer head dim
    index_topk: int = 512             # compressed entries each query keeps in C4 layers
    hc_mult: int = 4                  # mHC residual streams M
    hc_sinkhorn_iters: int = 20       # Sinkhorn-Knopp iterations for comb
    hc_eps: float = 1e-6              # mHC additive eps
    # Fields of the official file that describe the released weights' storage, kept so it loads as is.
    max_batch_size: int = 4           # official decode-cache size (unused by the training forward)
    max_seq_len: int = 4096           # official decode-cache size (unused by the training forward)
    dtype: str = "fp8"                # storage of the non-expert linears in the release: fp8 | bf16
    scale_fmt: str = "ue8m0"          # power-of-two (E8M0) scales
    expert_dtype: str = "fp4"         # storage of routed experts in the release: fp4 | fp8
    scale_dtype: str = "fp8"          # scales stored as float8_e8m0fnu
    # nanoflash switches.
    qat: bool = False                 # simulate the official FP8/FP4 activation quantization (straight-through)
    attn_chunk: int = 1024            # queries per attention chunk (memory knob; results do not depend on it)
    kernels: str = "auto"             # auto (GPU-proven kernels) | reference | triton (+ mHC, bf16 GEMMs)

    def __post_init__(self):
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        need = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != need:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries; n_layers + n_mtp_layers = {need}")
        bad = [r for r in self.compress_ratios if r != 0 and r < 2]
        if bad:
            raise ValueError(f"compress_ratios entries must be 0, 4 (overlapping C4) or a non-overlapping ratio >= 2: {bad}")
        if self.head_dim <= self.rope_head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim={self.rope_head_dim} must be even and < head_dim={self.head_dim}")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"n_heads*head_dim={self.n_heads * self.head_dim} not divisible by o_groups={self.o_groups}")
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"top-k {self.n_activated_experts} > n_routed_experts {self.n_routed_experts}")
        if self.n_shared_experts != 1:
            raise ValueError(f"V4 has exactly one shared expert, got n_shared_experts={self.n_shared_experts}")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unknown score_func {self.score_func!r}")
        if self.kernels not in ("auto", "reference", "triton"):
            raise ValueError(f"ModelConfig.kernels must be auto|reference|triton, got {self.kernels!r}")

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Official `inference/config.json` keys; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, path: str) -> "ModelConfig":
        """Read a HF `config.json` (or the checkpoint directory holding it), or an official inference config."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read model config {path}: {e}") from e
        if "dim" in hf:  # already official ModelArgs names
            return cls.from_dict(hf)
        if "nanoflash" in hf:  # written by save_hf_checkpoint: the exact nanoflash config travels along
            return cls.from_dict(hf["nanoflash"])
        return cls.from_dict(_hf_to_official(hf, path))

    def to_hf_dict(self) -> dict:
        """The HF `config.json` of this model (the inverse of `from_hf_config`)."""
        d = {hf: getattr(self, ours) for hf, ours in HF_KEYS.items()}
        d.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", torch_dtype="bfloat16",
                 num_key_value_heads=1, num_nextn_predict_layers=self.n_mtp_layers, bos_token_id=0,
                 eos_token_id=1, tie_word_embeddings=False, hidden_act="silu", topk_method="noaux_tc",
                 norm_topk_prob=True, compress_ratios=list(self.compress_ratios), attention_bias=False,
                 max_position_embeddings=int(self.original_seq_len * self.rope_factor), initializer_range=0.02,
                 rope_scaling={"type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                               "beta_slow": self.beta_slow,
                               "original_max_position_embeddings": self.original_seq_len})
        d["nanoflash"] = dataclasses.asdict(self)
        d["nanoflash"]["compress_ratios"] = list(self.compress_ratios)
        return d

    # ---------------------------------------------------------------- layer schedule
    def is_hash_layer(self, layer_id: int) -> bool:
        """Hash routing on the first n_hash_layers backbone layers (never on MTP, whose id is >= n_layers)."""
        return layer_id < self.n_hash_layers


# HF config key -> ModelConfig field (v4_notes §1.2); rope_scaling.* handled separately.
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers", "num_hash_layers": "n_hash_layers", "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit", "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps",
    "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "sliding_window": "window_size",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
}


def _hf_to_official(hf: dict, path: str) -> dict:
    missing = [k for k in ("hidden_size", "num_hidden_layers", "compress_ratios") if k not in hf]
    if missing:
        raise ValueError(f"{path}: HF DeepSeek-V4 config lacks {missing}")
    d = {ours: hf[k] for k, ours in HF_KEYS.items() if k in hf}
    d["n_mtp_layers"] = hf.get("num_nextn_predict_layers", 1)
    d["compress_ratios"] = tuple(hf["compress_ratios"])[: d["n_layers"] + d["n_mtp_layers"]]
    rs = hf.get("rope_scaling") or {}
    if rs:
        d.update(rope_factor=rs.get("factor", 16.0), beta_fast=rs.get("beta_fast", 32),
                 beta_slow=rs.get("beta_slow", 1), original_seq_len=rs.get("original_max_position_embeddings", 65536))
    q = hf.get("quantization_config") or {}
    d["dtype"] = "fp8" if q.get("quant_method") == "fp8" else "bf16"
    return d


def _flash() -> ModelConfig:
    return ModelConfig()


def _small() -> ModelConfig:
    return ModelConfig(
        dim=2048, moe_inter_dim=1024, n_layers=8, n_hash_layers=3, n_routed_experts=16, n_activated_experts=6,
        q_lora_rank=1024, o_lora_rank=512, compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4, 0))


def _h200() -> ModelConfig:
    """`small`'s per-layer geometry (SGLang-served, FP8 dims multiples of 128) cut to 4 layers, the mix SGLang
    0.5.16 was seen serving (sliding, C4, C128, C4), no MTP: ~1.2B parameters, for GRPO colocated with SGLang
    on one H200 (scripts/grpo_h200.sh)."""
    return dataclasses.replace(_small(), n_layers=4, n_hash_layers=1, n_mtp_layers=0, compress_ratios=(0, 4, 128, 4))


def _tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, dim=64, moe_inter_dim=32, n_layers=4, n_hash_layers=2, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, q_lora_rank=32, head_dim=32, rope_head_dim=8,
        o_groups=2, o_lora_rank=16, window_size=8, compress_ratios=(0, 4, 8, 4, 0), original_seq_len=64,
        rope_factor=4.0, index_n_heads=2, index_head_dim=16, index_topk=4, max_seq_len=256)


PRESETS = {"flash": _flash, "small": _small, "h200": _h200, "tiny": _tiny}


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh preset config, e.g. `preset("tiny", qat=True)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)


def run_preset(cfg: RunConfig) -> ModelConfig:
    """The model a run builds from no checkpoint: preset `cfg.train.preset` with `cfg.model` (the --model.*
    overrides) on top. `startup.model_config` starts from a checkpoint's own config when there is one."""
    return preset(cfg.train.preset, **cfg.model)

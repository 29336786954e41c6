"""Configuration: one module of plain dataclasses.

`ModelConfig` uses the field names of DeepSeek's official `inference/config.json` (`ModelArgs`), so
`ModelConfig(**json.load(open("inference/config.json")))` works as is, and `ModelConfig.from_hf_config(path)`
reads the Hugging Face `config.json` through the key table of v4_notes §1.2:

    hidden_size -> dim, moe_intermediate_size -> moe_inter_dim, num_hidden_layers -> n_layers, ...

Presets (`PRESETS`):
    flash  the published DeepSeek-V4-Flash (284B MoE, 43 layers + 1 MTP layer).
    small  the real per-head geometry (64 heads x 512, rope 64, indexer 64 x 128, hc 4, window 128, every FP8
           weight dim a multiple of 128 so real SGLang can serve it) with 8 layers and 16 experts: ~1.9B params.
    tiny   a few hundred thousand parameters for CPU tests: sliding-only, C4 and "C128" (ratio 8) layers,
           hash and score routing, MTP.

The run's tree (`RunConfig`: train, grpo, optim, parallel, rollout, eval) follows the model's: what `train.py`
reads; `nanoflash/cli.py` sets any field as `--<section>.<field> value`. `RunConfig.model` holds `ModelConfig`
overrides as a dict, applied on top of the preset (`run_preset`).

Tests: `pytest tests/test_export.py` (from_hf_config), `tests/test_model.py` (preset parameter counts),
`tests/test_train_cli.py`, `tests/test_startup.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field



INDEXER_QUANTS = ("qat", "fp8", "fp4", "none")   # ModelConfig.indexer_quant


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
    shared_expert_clamp: bool = False  # clamp the shared expert's gate/up at swiglu_limit too. Official: no;
                                      # SGLang 0.5.16: yes (srt/models/deepseek_v2.py 725-732, the DeepseekV2MoE
                                      # its deepseek_v4.py builds): the recipes that roll out through it set it
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
    indexer_quant: str = "qat"        # the C4 indexer's q and keys: qat follows `qat` (official Hadamard + FP4
                                      # when on, exact when off); fp8 = SGLang 0.5.16's FP8 index scores on Hopper
                                      # (quant.fp8_index_sim), with or without qat; fp4 / none: always that
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
        if self.indexer_quant not in INDEXER_QUANTS:
            raise ValueError(f"ModelConfig.indexer_quant must be one of {INDEXER_QUANTS}, got {self.indexer_quant!r}")
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
    """DeepSeek-V4-Flash as released; GPUs only (recipe flash)"""
    return ModelConfig()


def _small() -> ModelConfig:
    """Flash's layer kinds, shrunk, with the V4 tokenizer's vocabulary; one GPU (recipe gpu)"""
    return ModelConfig(
        dim=2048, moe_inter_dim=1024, n_layers=8, n_hash_layers=3, n_routed_experts=16, n_activated_experts=6,
        q_lora_rank=1024, o_lora_rank=512, compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4, 0))


def _tiny() -> ModelConfig:
    """every layer kind at toy size, for the CPU: tests, the demo (which cuts the vocabulary to 18)"""
    return ModelConfig(
        vocab_size=256, dim=64, moe_inter_dim=32, n_layers=4, n_hash_layers=2, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, q_lora_rank=32, head_dim=32, rope_head_dim=8,
        o_groups=2, o_lora_rank=16, window_size=8, compress_ratios=(0, 4, 8, 4, 0), original_seq_len=64,
        rope_factor=4.0, index_n_heads=2, index_head_dim=16, index_topk=4, max_seq_len=256)


PRESETS = {"flash": _flash, "small": _small, "tiny": _tiny}


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh preset config, e.g. `preset("tiny", qat=True)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)


# ---------------------------------------------------------------------------------------------- the run
TRANSPORTS = ("tensor", "local", "disk", "distributed")  # weight push (rollout/transports.py)
# Fields holding a secret: never written in clear (cli.to_dict redacts a literal value; `env:VAR` stays)
SECRET_FIELDS = ("rollout.api_key",)

@dataclass
class GRPOConfig:
    """GRPO loss and dynamic-sampling knobs; defaults are Miles' DeepSeek-V4-Flash recipe (rl_notes §2.7).

    Read by `nanoflash.grpo` (`group_advantages`, `policy_loss`, `filter_groups`, `prompts_to_request`).
    """

    n_prompts: int = 32               # groups kept per rollout step (Miles --rollout-batch-size)
    group_size: int = 8               # samples per prompt (--n-samples-per-prompt)
    std_normalize: bool = True        # divide advantages by the group std (False = Dr.GRPO)
    adv_eps: float = 1e-6             # added to the group std
    clip_low: float = 0.2             # PPO ratio clip below 1 (--eps-clip)
    clip_high: float = 0.28           # PPO ratio clip above 1, DAPO clip-higher (--eps-clip-high)
    clip_c: float | None = None       # dual-clip bound for negative advantages (--eps-clip-c); None = off
    use_tis: bool = False             # truncated importance sampling on exp(old - rollout) (--use-tis, Miles default off)
    tis_cap: float = 2.0              # TIS upper clamp (Miles --tis-clip)
    kl_coef: float = 0.0              # KL-to-reference coefficient: must be 0 (no reference policy is kept; V4 recipe: 0)
    kl_type: str = "low_var_kl"       # KL estimator k1|k2|k3|low_var_kl: only with a KL term, so must stay the default
    entropy_coef: float = 0.0         # entropy bonus: must be 0 (no entropy backward through the chunked head; recipe: 0)
    aggregation: str = "seq-mean-token-mean"  # loss aggregation: seq-mean-token-mean (Miles) | token-mean (DAPO)
    dynamic_sampling: bool = True     # drop groups whose rewards are all equal
    over_sampling_batch_size: int = 512  # prompts submitted per chunk while too few groups are kept
    adaptive_over_sampling: bool = False  # size each round from the keep rate seen (grpo.prompts_for_rate), at most the
                                          # chunk; off = Miles' whole chunk every round

    def __post_init__(self):
        if self.aggregation not in ("seq-mean-token-mean", "token-mean"):
            raise ValueError(f"GRPOConfig.aggregation must be seq-mean-token-mean or token-mean, "
                             f"got {self.aggregation!r}")
        if self.group_size < 1 or self.n_prompts < 1:
            raise ValueError(f"GRPOConfig: n_prompts={self.n_prompts}, group_size={self.group_size} must be >= 1")
        if self.kl_coef != 0.0 or self.kl_type != "low_var_kl":  # read by nobody: refused, never silently ignored
            raise ValueError(f"grpo.kl_coef={self.kl_coef}, grpo.kl_type={self.kl_type!r}: the trainer keeps no "
                             f"reference policy (the V4 recipe trains without KL), so there is no KL term to set")
        if self.entropy_coef != 0.0:
            raise ValueError(f"grpo.entropy_coef={self.entropy_coef}: an entropy bonus needs the full-vocabulary "
                             f"entropy through the chunked head's backward, which is not implemented; leave it 0")


# Activation recomputation (`ParallelConfig.recompute`): the sub-blocks of a layer that can run under
# torch.utils.checkpoint (model.py: `recomputed`), so that only their inputs are kept for backward and their inner
# activations are recomputed there. Cheap to recompute: mhc, norm, swiglu (elementwise and the small mHC mixes);
# the others recompute GEMMs. Never recomputed by a sub-block policy: the attention kernel (its outputs and LSE are
# kept), the indexer, the gate and the dispatch (the routed experts' inputs are kept: no exchange runs twice).
RECOMPUTE_BLOCKS = {
    "mhc": "hc_pre (mixes, Sinkhorn, collapse) and hc_post of both sublayers",
    "norm": "attn_norm and ffn_norm (their fp32 intermediates)",
    "swiglu": "the experts' SwiGLU (the shared expert; routed experts on the per-expert loop; the fused kernel "
              "already keeps only its bf16 input)",
    "attn_q": "wq_b -> per-head RMS -> rope (recomputes the wq_b GEMM; the un-roped q [H*Dh] is not kept)",
    "attn_out": "inverse rope -> wo_a -> wo_b from the kept attention output (recomputes both GEMMs)",
    "experts": "the routed experts (GEMMs and SwiGLU) from their kept dispatched inputs",
}
RECOMPUTE_PRESETS = {"none": (), "full": ("layer",), "selective": ("mhc", "norm", "swiglu")}


def recompute_blocks(value) -> frozenset:
    """A `ParallelConfig.recompute` value -> the set of recomputed sub-blocks ("layer" = the whole layer):
    none | full | selective | a comma list of RECOMPUTE_BLOCKS names; a bool means full / none."""
    if isinstance(value, (bool, frozenset, set, tuple, list)):
        names = ("layer",) if value is True else () if value is False else tuple(value)
    else:
        text = {"true": "full", "false": "none"}.get(str(value).strip().lower(), str(value).strip().lower())
        names = RECOMPUTE_PRESETS.get(text, tuple({"full": "layer"}.get(n.strip(), n.strip())
                                                  for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in RECOMPUTE_BLOCKS and n != "layer"]
    if bad or ("layer" in names and len(set(names)) > 1):
        raise ValueError(f"parallel.recompute={value!r}: " + (f"unknown sub-block(s) {bad}; " if bad else
                         "full (the whole layer) cannot be combined with sub-blocks; ") +
                         f"use none | full | selective (= {','.join(RECOMPUTE_PRESETS['selective'])}) | a comma "
                         f"list of {', '.join(RECOMPUTE_BLOCKS)}")
    return frozenset(names)


@dataclass
class ParallelConfig:
    """The training engine's layout and memory knobs (read by `nanoflash.parallel`).

    world = pp * dp * ep; dp=None means "whatever the world size leaves". The reference deployment (Miles,
    V4-Flash on 16 MI355X) is pp=4, ep=4, dp=1 with recompute and optimizer offload.
    """

    pp: int = 1                       # pipeline stages
    ep: int = 1                       # expert-parallel shards (experts split across these ranks)
    dp: int | None = None             # data-parallel replicas; None = world // (pp * ep)
    layer_split: tuple | None = None  # backbone layers per stage, e.g. (10, 11, 11, 11); None = even split
    micro_batch_tokens: int = 8192    # max tokens per micro-batch per GPU (variable-length sequences packed)
    recompute: str = "none"           # activation recomputation: none | full (every layer) | selective (mhc, norm,
                                      # swiglu) | a comma list of mhc, norm, swiglu, attn_q, attn_out, experts
                                      # (config.RECOMPUTE_BLOCKS says what each keeps and recomputes)
    offload_optimizer: bool = False   # keep fp32 master weights and Adam moments in host memory
    device: str = "auto"              # where this rank's stage lives: auto (cuda:LOCAL_RANK under nccl, else cpu) | cpu | cuda
    timeout_s: int = 1800             # training collectives (NCCL all-to-all, P2P, all-reduce) raise after this
    wait_timeout_s: int = 7200        # ranks waiting for rank 0's rollout / eval / push (gloo side group)
    colocate_ranks: bool = False      # every rank on one GPU (cuda:0): gloo collectives, P2P through host buffers
                                      # (NCCL refuses two ranks of a group on one GPU; parallel/colocate.py)
    gpu_memory_fraction: float = 0.0  # 0: no cap; else the share of this rank's GPU its allocator may hold (a
                                      # trainer beside a rollout server on the same GPU: past it the caching
                                      # allocator frees its cache and retries, then raises, instead of growing
                                      # into the server's memory; trainer.cap_gpu_memory)

    def __post_init__(self):
        for name in ("pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name}={getattr(self, name)} must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"ParallelConfig.dp={self.dp} must be >= 1 or None")
        if self.layer_split is not None:
            self.layer_split = tuple(int(n) for n in self.layer_split)
            if len(self.layer_split) != self.pp or min(self.layer_split) < 1:
                raise ValueError(f"layer_split {self.layer_split} needs pp={self.pp} entries, each >= 1")
        legacy = {True: "full", False: "none", "true": "full", "false": "none"}   # the former bool field
        self.recompute = legacy.get(self.recompute, self.recompute)
        recompute_blocks(self.recompute)   # one error naming a bad value now, not at the first forward
        if self.micro_batch_tokens < 1:
            raise ValueError(f"ParallelConfig.micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ParallelConfig.device must be auto|cpu|cuda, got {self.device!r}")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"ParallelConfig.gpu_memory_fraction={self.gpu_memory_fraction} must be in [0, 1] "
                             f"(0: no cap)")
        if self.timeout_s < 1 or self.wait_timeout_s < 1:
            raise ValueError(f"ParallelConfig: timeout_s={self.timeout_s}, wait_timeout_s={self.wait_timeout_s} "
                             f"must be >= 1 second")


@dataclass
class OptimConfig:
    """AdamW with fp32 master weights; defaults are the V4 RL recipe (Miles): lr 1e-6, wd 0.1, betas 0.9/0.98."""

    lr: float = 1e-6                  # learning rate
    weight_decay: float = 0.1         # decoupled weight decay (matrices only; norms/biases/frozen get none)
    beta1: float = 0.9                # Adam first-moment decay
    beta2: float = 0.98               # Adam second-moment decay
    eps: float = 1e-8                 # Adam denominator eps
    grad_clip: float = 1.0            # global gradient-norm clip across all ranks (0 = off)
    train_mtp: bool = False           # also train the MTP block (frozen in the V4 RL recipe)
    round_to_served: bool = True      # with rollout.weights=fp8: fp32 weights the push sends bf16 (norms, head,
                                      # compressors) hold bf16 values, their fp32 master the updates (rl/trainer.py)


@dataclass
class RolloutConfig:
    """Where rollouts come from and how weights reach them (read by `nanoflash.rl.trainer`).

    Empty `urls` = train.py starts `n_servers` embedded nanoflash servers itself (in-process threads, SGLang
    protocol over HTTP on 127.0.0.1); otherwise it talks to the SGLang servers at those URLs.
    """

    urls: tuple = ()                  # external SGLang servers, e.g. ("http://node0:30000",); () = embedded
    n_servers: int = 1                # embedded servers to start when urls is empty
    weights: str = "fp8"              # embedded engine precision: fp8 (e4m3 blocks) | bf16 | fp32 (= matched)
    temperature: float = 1.0          # sampling temperature; the trainer scores log_softmax(logits / T)
    top_p: float = 1.0                # nucleus sampling (rollout)
    max_new_tokens: int = 8           # response limit (Miles --rollout-max-response-len)
    max_workers: int = 0              # /generate requests in flight at once; 0 = every request of a round, up to what the
                                      # servers say they run (/server_info: max running requests x DP ranks, over n)
    bucket_bytes: int = 1 << 30       # weight-sync bucket size (V4 recipe: 1 GiB)
    transport: str = "tensor"         # weight push: tensor | local (embedded servers, this process) | disk | distributed
    sync_addr: str = "127.0.0.1:29600"  # host:port of the trainer's rank 0 for transport=distributed (NCCL/gloo group)
    verify: bool = True               # compare /weights_checker checksums after every push
    routing_replay: bool = False      # R3: replay the rollout engine's expert choices in the trainer forward
    indexer_replay: bool = False      # replay the rollout engine's C4 kept entries in the trainer forward (Miles'
                                      # indexer replay; the servers must report return_indexer_topk)
    max_rounds: int = 8               # over-sampling rounds per step before training on what was kept
    partial: bool = False             # partial rollouts (Miles --partial-rollout): the groups a step's tail abort leaves
                                      # unfinished are continued next step, their tokens keeping their log-probs (TIS)
    asynchronous: bool = False        # one step off (Miles train_async.py): step k+1's rollout runs while step k trains;
                                      # the push waits for it to end (rl/schedule.py); needs grpo.use_tis
    max_staleness: int = 1            # steps a trained token may lag the policy it updates: asynchronous pushes when the
                                      # next rollout would exceed it; carried groups past it are dropped
    health_timeout_s: float = 900.0   # wait this long for every external server's /health before the first push
                                      # and for a lost one (rollout.max_server_restarts)
    retry_s: float = 30.0             # connection retries of one request (backoff) before its server counts as gone
    update_timeout_s: float = 3600.0  # read timeout of one weight-update call (a bucket's load); a sent POST is never
                                      # re-sent, so this is how long a push waits for a server that took one
    max_server_restarts: int = 0      # a server lost in a rollout, an eval or a push: wait health_timeout_s for it (its
                                      # supervisor restarts it), re-push, redo -- this many times a run; 0 = stop
    api_key: str = ""                 # the servers' --api-key (sent as Bearer; also set on embedded ones); env:VAR reads $VAR

    def __post_init__(self):
        self.urls = tuple(self.urls)
        self.key()  # env:VAR must be set now, not at the first push
        if self.weights not in ("fp8", "bf16", "fp32"):
            raise ValueError(f"RolloutConfig.weights must be fp8|bf16|fp32, got {self.weights!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"RolloutConfig.transport must be {'|'.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "local" and self.urls:
            raise ValueError("RolloutConfig.transport=local hands tensors to the embedded servers of this process; "
                             f"with rollout.urls {list(self.urls)} use tensor, distributed or disk")
        if self.max_server_restarts < 0 or self.retry_s < 0:
            raise ValueError(f"RolloutConfig: max_server_restarts={self.max_server_restarts} and retry_s="
                             f"{self.retry_s} must be >= 0")
        if self.n_servers < 1 or self.max_new_tokens < 1 or self.max_rounds < 1:
            raise ValueError(f"RolloutConfig: n_servers={self.n_servers}, max_new_tokens={self.max_new_tokens}, "
                             f"max_rounds={self.max_rounds} must all be >= 1")
        if self.max_workers < 0 or self.max_staleness < 0:
            raise ValueError(f"RolloutConfig: max_workers={self.max_workers} and max_staleness={self.max_staleness} "
                             f"must be >= 0")
        need = 2 if self.asynchronous and self.partial else 1 if self.asynchronous else 0
        if self.max_staleness < need:
            why = ("a carried token of a one-step-off run is trained two steps after the weights that sampled it"
                   if self.partial else "a one-step-off run trains every sample one step after its weights")
            raise ValueError(f"rollout.max_staleness={self.max_staleness}: {why}; set it to {need} or more")


    def key(self) -> str | None:
        """The API key itself; `env:VAR` reads $VAR (so config.json records the variable's name, not the key)."""
        if not self.api_key.startswith("env:"):
            return self.api_key or None
        name = self.api_key[len("env:"):]
        if not os.environ.get(name):
            raise ValueError(f"rollout.api_key={self.api_key!r}: the environment variable {name} is not set")
        return os.environ[name]


@dataclass
class EvalConfig:
    """Offline evaluation every `every` steps: k samples per held-out problem, unbiased pass@k (evaluate.py)."""

    every: int = 10                   # steps between evals (0 = never; step 0 and the last step always when > 0)
    n_problems: int = 500             # held-out problems (arith) or the first n of the eval file
    k_samples: int = 4                # samples per problem (pass@1..k)
    temperature: float = 1.0          # eval sampling temperature (Miles: falls back to the rollout temperature)
    max_new_tokens: int = 8           # eval response limit (Miles V4: 4096)
    data: str = "../shared/data/aime24.jsonl"  # eval file (jsonl / parquet) for task=dapo|chat, relative to the cwd
    prompt_key: str = ""              # eval file's prompt field, dotted for nested ("" = prompt, else problem)
    answer_key: str = ""              # eval file's answer field ("" = reward_model.ground_truth, else label, else answer)
    top_p: float = 1.0                # eval nucleus sampling (Miles V4: 0.7)
    path: str = "auto"                # batched (in-process on an embedded engine) | servers (rollout client) | auto
    before_train: bool = True         # also evaluate at step 0 (Miles: --skip-eval-before-train turns it off)

    def __post_init__(self):
        if self.path not in ("auto", "batched", "servers"):
            raise ValueError(f"EvalConfig.path must be auto|batched|servers, got {self.path!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"EvalConfig.top_p={self.top_p} must be in (0, 1]")


@dataclass
class TrainConfig:
    """The run itself: model source, task, steps, checkpoints, logging (read by `train.py`)."""

    preset: str = "tiny"              # model preset (ignored when `checkpoint` is a HF directory)
    checkpoint: str = ""              # HF-layout directory or nanoflash DCP checkpoint to start from ("" = init)
    task: str = "arith"               # arith (synthetic, CPU demo) | dapo (DAPO instruction added) | chat (prompts as is)
    data: str = "../shared/data/dapo_math_17k.parquet"  # training parquet / jsonl (task=dapo|chat), relative to the cwd
    prompt_key: str = ""              # training file's prompt field, dotted for nested ("" = prompt, else problem)
    answer_key: str = ""              # training file's answer field ("" = reward_model.ground_truth, else label, else answer)
    reward: str = ""                  # reward plug-in "module:function" (contract: nanoflash/rl/plugins.py); "" = the task's own
    reward_timeout_s: float = 10.0    # per response: a plug-in call past this is killed and scores 0
    reward_workers: int = 2           # processes running the reward plug-in
    difficulty: int = 1               # arith operand digits
    steps: int = 20                   # GRPO steps
    seed: int = 1234                  # one seed for init, data order and per-request sampling seeds (Miles 1234)
    out_dir: str = "runs/tiny"        # metrics.jsonl, checkpoints/, plots/
    save_every: int = 10              # checkpoint every n steps (0 = only at the end, -1 = never)
    keep: int = 2                     # checkpoints kept
    async_save: bool = False          # write checkpoints in a thread while the next step's rollout runs
                                      # (parallel/dcp.py; the weights are not copied: the step waits for it)
    resume: bool = True               # continue from the newest checkpoint in out_dir if there is one
    warmup_steps: int = 0             # supervised warm-up steps on reference answers before RL (0 = pure RL)
    warmup_lr: float = 3e-3           # warm-up learning rate
    warmup_batch: int = 64            # warm-up problems per step
    warmup_data: str = ""             # warm-up problems: "" = the task's own, with their answers; arith:copy (the demo)
    lr_warmup_steps: int = 0          # GRPO learning rate ramps linearly from lr/n to lr over the first n steps
    dtype: str = "fp32"               # trainer parameter dtype: fp32 | bf16
    threads: int = 0                  # torch intra-op threads (0 = torch's default)
    tensorboard: bool = False         # also log to TensorBoard (if installed)
    wandb: str = ""                   # W&B project name ("" = off; needs wandb installed)
    progress: bool = True             # tqdm progress bars (if installed)
    plots: bool = True                # PNG figures at the end (if matplotlib is installed)
    dry_run: bool = False             # print the per-GPU memory plan of the configured layout and exit
    max_skipped_steps: int = 3        # consecutive non-finite (skipped) GRPO steps before the run stops
    max_abs_weight: float = 1e4       # an update leaving any |w| above this has exploded: stop, nothing pushed or
                                      # saved. Weights start O(1) (norm scales 1, matrices std <= 0.02) and Adam
                                      # moves each by ~lr a step; 1e4 is far past any trained value, far below fp32
                                      # overflow (two chained linears at D=4096 overflow only past ~1e15)
    hooks: tuple = ()                 # instruments attached to the loop: module:Class,... (nanoflash/rl/hooks.py)

    def __post_init__(self):
        if self.task not in ("arith", "dapo", "chat"):
            raise ValueError(f"TrainConfig.task must be arith|dapo|chat, got {self.task!r}")
        if self.reward_timeout_s <= 0 or self.reward_workers < 1:
            raise ValueError(f"TrainConfig: reward_timeout_s={self.reward_timeout_s} must be > 0 and "
                             f"reward_workers={self.reward_workers} >= 1")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.dtype must be fp32|bf16, got {self.dtype!r}")
        if not self.max_abs_weight > 0:
            raise ValueError(f"TrainConfig.max_abs_weight={self.max_abs_weight} must be > 0")
        if self.steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"TrainConfig: steps={self.steps}, warmup_steps={self.warmup_steps} must be >= 0")


@dataclass
class RunConfig:
    """The whole config tree of `train.py`; CLI overrides address it as `--<section>.<field> value`.

    `model` holds ModelConfig overrides on top of the preset (e.g. `--model.max_seq_len 64`).
    """

    train: TrainConfig = field(default_factory=TrainConfig)        # run, task, logging
    grpo: GRPOConfig = field(default_factory=GRPOConfig)           # loss and dynamic sampling
    optim: OptimConfig = field(default_factory=OptimConfig)        # AdamW
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # PP x EP x DP layout
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # engines and weight sync
    eval: EvalConfig = field(default_factory=EvalConfig)           # offline pass@k
    model: dict = field(default_factory=dict)                      # ModelConfig field overrides


def run_preset(cfg: RunConfig) -> ModelConfig:
    """The model a run builds from no checkpoint: preset `cfg.train.preset` with `cfg.model` (the --model.*
    overrides) on top. `startup.model_config` starts from a checkpoint's own config when there is one."""
    return preset(cfg.train.preset, **cfg.model)

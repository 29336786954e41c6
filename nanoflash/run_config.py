"""The run's config tree: `RunConfig` and its sections (train, grpo, optim, parallel, rollout, eval).

`RunConfig` is what `train.py` reads; `nanoflash/cli.py` sets any field from the command line as
`--<section>.<field> value`. The model's own hyper-parameters (`ModelConfig`, the presets) live in
`nanoflash/config.py`, which re-exports everything here, so `from nanoflash.config import RunConfig` is the
one import a reader needs. `RunConfig.model` holds `ModelConfig` overrides as a dict, applied on top of the
preset, so this module does not depend on the model's.

Tests: `pytest tests/test_train_cli.py tests/test_startup.py`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

TRANSPORTS = ("tensor", "local", "disk", "distributed")  # weight push (rollout/weight_sync.py)

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
    recompute: bool = False           # per-layer activation recomputation (checkpointing)
    offload_optimizer: bool = False   # keep fp32 master weights and Adam moments in host memory
    device: str = "auto"              # where this rank's stage lives: auto (cuda:LOCAL_RANK under nccl, else cpu) | cpu | cuda
    timeout_s: int = 1800             # training collectives (NCCL all-to-all, P2P, all-reduce) raise after this
    wait_timeout_s: int = 7200        # ranks waiting for rank 0's rollout / eval / push (gloo side group)

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
        if self.micro_batch_tokens < 1:
            raise ValueError(f"ParallelConfig.micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ParallelConfig.device must be auto|cpu|cuda, got {self.device!r}")
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
                                      # compressors) hold bf16 values, their fp32 master the updates (actor.py)


@dataclass
class RolloutConfig:
    """Where rollouts come from and how weights reach them (read by `nanoflash.rl.actor`).

    Empty `urls` = train.py starts `n_servers` embedded nanoflash servers itself (in-process threads, SGLang
    protocol over HTTP on 127.0.0.1); otherwise it talks to the SGLang servers at those URLs.
    """

    urls: tuple = ()                  # external SGLang servers, e.g. ("http://node0:30000",); () = embedded
    n_servers: int = 1                # embedded servers to start when urls is empty
    weights: str = "fp8"              # embedded engine precision: fp8 (e4m3 blocks) | bf16 | fp32 (= matched)
    temperature: float = 1.0          # sampling temperature; the trainer scores log_softmax(logits / T)
    top_p: float = 1.0                # nucleus sampling (rollout)
    max_new_tokens: int = 8           # response limit (Miles --rollout-max-response-len)
    max_workers: int = 8              # concurrent /generate requests from the trainer
    bucket_bytes: int = 1 << 30       # weight-sync bucket size (V4 recipe: 1 GiB)
    transport: str = "tensor"         # weight push: tensor | local (embedded servers, this process) | disk | distributed
    sync_addr: str = "127.0.0.1:29600"  # host:port of the trainer's rank 0 for transport=distributed (NCCL/gloo group)
    verify: bool = True               # compare /weights_checker checksums after every push
    routing_replay: bool = False      # R3: replay the rollout engine's expert choices in the trainer forward
    max_rounds: int = 8               # over-sampling rounds per step before training on what was kept
    health_timeout_s: float = 900.0   # wait this long for every external server's /health before the first push
    retry_s: float = 30.0             # connection retries of one request (backoff) before its server counts as gone
    update_timeout_s: float = 3600.0  # read timeout of one weight-update call (a bucket's load); a sent POST is never
                                      # re-sent, so this is how long a push waits for a server that took one
    max_server_restarts: int = 0      # a server that dies mid-rollout: wait health_timeout_s for it to come back (its
                                      # supervisor restarts it), re-push, redo the step -- this many times a run; 0 = stop
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
    live: bool = False                # probe every push, FP8 floor, |dlogp| tails, warm start re-evaluated (live.py; 1 process)

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

    def __post_init__(self):
        if self.task not in ("arith", "dapo", "chat"):
            raise ValueError(f"TrainConfig.task must be arith|dapo|chat, got {self.task!r}")
        if self.reward_timeout_s <= 0 or self.reward_workers < 1:
            raise ValueError(f"TrainConfig: reward_timeout_s={self.reward_timeout_s} must be > 0 and "
                             f"reward_workers={self.reward_workers} >= 1")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.dtype must be fp32|bf16, got {self.dtype!r}")
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

"""Command line of `train.py`: one dataclass tree (`config.RunConfig`), named run recipes, dotted overrides.

    python train.py --recipe demo --grpo.clip_high 0.28 --rollout.weights fp32 --model.max_seq_len 64
    python train.py --preset flash --parallel.pp 4 --parallel.ep 4 --dry-run

Resolution order (later wins): dataclass defaults -> `--recipe NAME` (a list of overrides in `RECIPES`) ->
the command line. An override is `--section.field value` (or `--section.field=value`); the value is parsed
by the field's declared type: int, float, bool (`true/false/1/0/yes/no`), str, `None`/`none` for optional
fields, and comma lists for tuples (`--rollout.urls http://a:30000,http://b:30000`). `--model.<field>`
overrides a `ModelConfig` field of the preset. Short forms: `--preset` = `--train.preset`, `--dry-run` =
`--train.dry_run true`, `--steps` = `--train.steps`, `--out` = `--train.out_dir`. An unknown section or field,
or a value that does not parse, is one error naming it.

`--help` (`help_text`) lists every section and field with its type, default and comment, read from
`config.py`, and the recipes. What train.py does with the parsed tree first: `nanoflash/startup.py`.

Differs from Miles: Miles has ~400 flat argparse flags; we keep the config as the dataclasses of
`config.py` and address their fields by path.

Tests: `pytest tests/test_train_cli.py -q`.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
import typing

from nanoflash.config import ModelConfig, RunConfig

SHORT = {"--preset": "train.preset", "--steps": "train.steps", "--out": "train.out_dir",
         "--checkpoint": "train.checkpoint", "--seed": "train.seed"}
FLAGS = {"--dry-run": ("train.dry_run", "true"), "--no-resume": ("train.resume", "false")}

# one line per recipe for --help (a recipe without one is listed with its overrides)
RECIPE_HELP = {
    "demo": "CPU demo: tiny model, synthetic arithmetic, embedded FP8 server (docs/demo.md)",
    "demo-control": "the demo's control: its warm start continued for the demo's 60 steps on its own data, no GRPO",
    "smoke": "a few-step CPU smoke of the demo's loop (CI)",
    "h200": "issue 20: GRPO of the h200 preset with live SGLang on one H200 (scripts/grpo_h200.sh; docs/h200/)",
    "flash": "the reference deployment's trainer: V4-Flash, PP4 x EP4, DAPO-Math-17K (use with --dry-run first)",
}
# Recipes that only make sense on GPUs: on a machine where torch sees none, startup stops naming what it found
# (`startup.check_gpu`) instead of running a 284B model or an H200 recipe on the CPU (issue 38).
GPU_RECIPES = ("flash", "gpu", "h200")
# Named recipes: lists of overrides applied before the command line.
RECIPES: dict[str, list[str]] = {
    # CPU demo (docs/demo.md): tiny model; a warm start that copies the last digit ("0527+0=" -> "7", format
    # only: none of the answers), then GRPO on "last digit of a + 1" ("0527+1=" -> "8") through the embedded
    # FP8 server, whose answers only the reward teaches; held out: 1,000 problems whose leading digits no
    # training prompt has. Checkpoints at every eval (0, 20, 40, 60) for the probes of scripts/demo_controls.py.
    "demo": ["train.preset=tiny", "train.task=arith", "train.data=arith:mod10", "train.difficulty=4",
             "train.warmup_data=arith:copy", "train.steps=60", "train.warmup_steps=30", "train.warmup_lr=3e-3",
             "train.out_dir=runs/demo", "train.save_every=20", "train.keep=4", "train.threads=1",
             "model.vocab_size=18", "model.max_seq_len=32",
             "grpo.n_prompts=16", "grpo.group_size=8", "grpo.over_sampling_batch_size=16",
             "optim.lr=1e-3", "train.lr_warmup_steps=5", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
             "parallel.micro_batch_tokens=2048",
             "rollout.weights=fp8", "rollout.max_new_tokens=2", "rollout.max_workers=4",
             "eval.every=20", "eval.n_problems=500", "eval.k_samples=8", "eval.max_new_tokens=2"],
    # the demo's control: the same warm start continued on its own (copy) data for the demo's 60 GRPO steps
    # (= the demo's overrides, then these; see below)
    "demo-control": ["train.warmup_steps=90", "train.steps=0", "train.out_dir=runs/demo-control"],
    # a few-step smoke of the same command (CI): same task and server, fewer steps, prompts and eval problems
    "smoke": ["train.preset=tiny", "train.task=arith", "train.data=arith:mod10", "train.difficulty=4",
              "train.steps=3", "train.warmup_steps=20", "train.warmup_batch=32", "train.threads=1",
              "train.out_dir=runs/smoke", "train.save_every=1", "model.vocab_size=18", "model.max_seq_len=32",
              "grpo.n_prompts=4", "grpo.group_size=4", "grpo.over_sampling_batch_size=4", "rollout.max_rounds=2",
              "optim.lr=1e-3", "rollout.max_new_tokens=2", "rollout.max_workers=2",
              "eval.every=2", "eval.n_problems=16", "eval.k_samples=2", "eval.max_new_tokens=2"],
    # the reference deployment's trainer: V4-Flash at PP4 x EP4 (16 GPUs on 2 nodes), Miles' V4 recipe
    "flash": ["train.preset=flash", "train.task=dapo", "train.dtype=bf16", "train.steps=200",
              "parallel.pp=4", "parallel.ep=4", "parallel.dp=1", "parallel.recompute=true",
              "parallel.offload_optimizer=true", "parallel.micro_batch_tokens=8192",
              "grpo.n_prompts=32", "grpo.group_size=8", "grpo.over_sampling_batch_size=512",
              "rollout.temperature=0.8", "rollout.max_new_tokens=4096", "rollout.routing_replay=true",
              "eval.every=20", "eval.k_samples=8", "eval.temperature=0.8", "eval.max_new_tokens=4096"],
    # one H200 (bench/gpu_recipe.py measures it): the `small` preset in bf16 from a seeded init (1.6B with the
    # arithmetic task's 18-id vocabulary: sampled ids outside it would stop the reward), AdamW offloaded, the
    # embedded FP8 engine in the same process on the same GPU (weights handed over in-process: transport=local),
    # 4 GRPO steps on the synthetic task, eval through the server every 2; no checkpoints (30 GB each with optimizer)
    "gpu": ["train.preset=small", "train.task=arith", "train.data=arith:mod10", "train.difficulty=4",
            "train.dtype=bf16", "train.steps=4", "train.save_every=-1", "train.out_dir=runs/gpu",
            "model.vocab_size=18", "model.max_seq_len=64", "parallel.device=cuda",
            "parallel.offload_optimizer=true", "parallel.micro_batch_tokens=2048", "grpo.n_prompts=8",
            "grpo.group_size=8", "grpo.over_sampling_batch_size=8", "grpo.dynamic_sampling=false",
            "rollout.weights=fp8", "rollout.transport=local", "rollout.max_new_tokens=16", "rollout.max_workers=8",
            "eval.every=2", "eval.before_train=false", "eval.path=servers", "eval.n_problems=16",
            "eval.k_samples=8", "eval.max_new_tokens=16"],
    # one H200, SGLang colocated (scripts/grpo_h200.sh, docs/h200/): the h200 preset (1.24B) in bf16, warm-started
    # by bench/grpo_h200.py sft (a model that can work sums out but mostly answers at a glance, synth.py), GRPO on
    # running sums in the V4 chat format through SGLang at --rollout.urls, a verified FP8 push + probe every step,
    # the warm start re-evaluated at every eval (eval.live). lr (docs/h200/): 2e-4 with a 3-step warm-up collapsed
    # (AdamW's fresh moments make the first updates full lr-sized steps), 3e-5 was stable but slow; 5e-5 after a
    # 10-step warm-up took held-out pass@1 0.094 -> 0.939 in 60 steps (run 4; run 5 0.088 -> 0.923). A dead SGLang is restarted by the
    # script's watchdog and waited for (rollout.max_server_restarts)
    "h200": ["train.preset=h200", "train.task=chat", "train.data=synth:sum4:train", "eval.data=synth:sum4:heldout",
             "train.dtype=bf16", "train.steps=60", "train.save_every=-1", "train.out_dir=runs/h200",
             "train.lr_warmup_steps=10", "model.kernels=reference", "parallel.device=cuda",
             "parallel.micro_batch_tokens=16384", "grpo.n_prompts=16", "grpo.group_size=8",
             "grpo.over_sampling_batch_size=16", "rollout.max_rounds=4", "rollout.weights=fp8",
             "rollout.transport=tensor", "rollout.bucket_bytes=536870912", "rollout.max_new_tokens=40",
             "rollout.max_workers=64", "rollout.max_server_restarts=3", "optim.lr=5e-5", "optim.weight_decay=0.0",
             "optim.grad_clip=1.0",
             "eval.every=10", "eval.path=servers", "eval.n_problems=128", "eval.k_samples=8",
             "eval.max_new_tokens=40", "eval.live=true"],
}
RECIPES["demo-control"] = RECIPES["demo"] + RECIPES["demo-control"]


def _parse_value(raw: str, tp, where: str):
    """Parse `raw` as the declared type `tp` (a typing object or a string annotation already resolved)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw.lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse_value(raw, inner[0], where)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: {raw!r} is not a bool (true/false)")
    if tp is tuple or origin is tuple:
        return tuple(x for x in raw.split(",") if x) if raw else ()
    if tp is dict:
        return json.loads(raw)
    try:
        return tp(raw) if tp in (int, float, str) else raw
    except ValueError as e:
        raise ValueError(f"{where}: cannot parse {raw!r} as {tp.__name__}") from e


def _model_field_type(name: str):
    hints = typing.get_type_hints(ModelConfig)
    if name not in hints:
        near = difflib.get_close_matches(name, list(hints), n=1)
        raise ValueError(f"--model.{name}: ModelConfig has no field {name!r}" +
                         (f" (did you mean --model.{near[0]}?)" if near else ""))
    return hints[name]


def apply_override(cfg: RunConfig, path: str, raw: str) -> None:
    """Set `cfg.<section>.<field>` from the string `raw`, in place."""
    section, _, name = path.partition(".")
    if not name:
        raise ValueError(f"--{path}: not an option; overrides look like --<section>.<field> VALUE (--help lists them)")
    if section == "model":
        tp = _model_field_type(name)
        cfg.model[name] = tuple(int(x) for x in raw.split(",")) if name == "compress_ratios" else \
            _parse_value(raw, tp, f"--{path}")
        return
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    if section not in sections:
        raise ValueError(f"--{path}: unknown section {section!r}; sections are {sorted(sections)}")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if name not in hints:
        near = difflib.get_close_matches(name, list(hints), n=1)
        hint = f" (did you mean --{section}.{near[0]}?)" if near else f"; fields are {sorted(hints)}"
        raise ValueError(f"--{path}: {type(obj).__name__} has no field {name!r}{hint}")
    setattr(obj, name, _parse_value(raw, hints[name], f"--{path}"))


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    """argv -> [(dotted path, raw value)], expanding short forms and flags."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in FLAGS:
            out.append(FLAGS[arg])
            i += 1
            continue
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --section.field value")
        key, eq, val = arg.partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"{arg} needs a value (--help lists the options)")
            val, i = argv[i + 1], i + 1
        i += 1
        out.append((SHORT.get(key, key[2:]), val))
    return out


def recipe_name(argv: list[str]) -> str | None:
    """The --recipe of a command line (the last one), or None."""
    names = [val for path, val in _pairs(list(argv)) if path == "recipe"]
    return names[-1] if names else None


def parse_args(argv: list[str]) -> RunConfig:
    """Defaults, then `--recipe`, then every other override, re-validated by each dataclass' checks."""
    cfg = RunConfig()
    pairs = _pairs(list(argv))
    for path, val in pairs:
        if path == "recipe":
            if val not in RECIPES:
                raise ValueError(f"--recipe {val!r}: unknown; recipes are {sorted(RECIPES)}")
            for item in RECIPES[val]:
                apply_override(cfg, *item.split("=", 1))
    for path, val in pairs:
        if path != "recipe":
            apply_override(cfg, path, val)
    for f in dataclasses.fields(cfg):  # re-run __post_init__ validation on the final values
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec):
            setattr(cfg, f.name, dataclasses.replace(sec))
    return cfg


def to_dict(cfg: RunConfig) -> dict:
    """JSON-able view of the whole tree (written to out_dir/config.json)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


# ---------------------------------------------------------------------------------------------- --help
def _field_comments(cls) -> dict:
    """field -> the `# comment` that ends its line in config.py (the one place fields are documented)."""
    src = inspect.getsource(cls)
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^    (\w+): [^\n]*?  # (.*)$", src, re.M)}


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):  # Optional[X]
        return _type_name(args[0]) + "|none"
    return "list" if tp is tuple or typing.get_origin(tp) is tuple else getattr(tp, "__name__", str(tp))


def _section_help(name: str, cls, default_obj, note: str = "") -> list[str]:
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    hints, comments = typing.get_type_hints(cls), _field_comments(cls)
    lines = [f"--{name}.* ({cls.__name__}): {doc}{note}"]
    for f in dataclasses.fields(cls):
        default = getattr(default_obj, f.name)
        left = f"  --{name}.{f.name} {_type_name(hints[f.name]).upper()} = {default!r}"
        lines.append(f"{left:<52} {comments.get(f.name, '')}")
    return lines


def help_text() -> str:
    """Every section and field (type, default, comment) and the recipes: what `train.py --help` prints."""
    short = ", ".join(f"{k} = --{v}" for k, v in SHORT.items())
    flags = ", ".join(f"{k} = --{p} {v}" for k, (p, v) in FLAGS.items())
    out = ["usage: python train.py [--recipe NAME] [--<section>.<field> VALUE | --<section>.<field>=VALUE ...]", "",
           "GRPO for DeepSeek-V4. Later wins: defaults -> --recipe -> the command line. Values parse by the field's",
           "type: int, float, bool (true/false), str, none (for |none fields), comma-separated lists.",
           f"Short forms: {short}; {flags}.", "", "recipes (--recipe NAME):"]
    out += [f"  {k:<8} {RECIPE_HELP.get(k) or ' '.join(v)}" for k, v in RECIPES.items()]
    cfg = RunConfig()
    for f in dataclasses.fields(RunConfig):
        if f.name != "model":
            out += [""] + _section_help(f.name, type(getattr(cfg, f.name)), getattr(cfg, f.name))
    out += [""] + _section_help("model", ModelConfig, ModelConfig(),
                                " -- overrides of the preset's value; the defaults shown are flash's")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- dry run
STORAGE_BYTES = {"fp8": 1.0, "fp4": 0.5, "bf16": 2.0, "fp32": 4.0, "int64": 8.0}  # per element, release storage


def rollout_weight_bytes(mcfg, push: bool = False) -> float:
    """Bytes of the released checkpoint's tensors (FP8 linears, FP4 experts, BF16/F32 rest; scales ignored),
    counted on a meta-built model: what one rollout engine must hold, split over its GPUs. push=True counts
    what a weight push sends instead: experts re-packed FP8 (one byte, as Miles on Hopper), no MTP block."""
    import torch

    from nanoflash.names import storage_kind
    from nanoflash.model import Transformer
    with torch.device("meta"):
        model = Transformer(mcfg)
    per = dict(STORAGE_BYTES, fp4=STORAGE_BYTES["fp8"] if push else STORAGE_BYTES["fp4"])
    return sum(t.numel() * per.get(storage_kind(n, mcfg), 2.0) for n, t in model.state_dict().items()
               if not (push and n.startswith("mtp.")))


def dry_run_text(cfg: RunConfig, gpus_per_node: int = 8, rollout_nodes: int = 2) -> str:
    """Per-GPU memory plan of the configured trainer layout (parallel.planner) plus the rollout side."""
    import contextlib
    import io

    from nanoflash.config import run_preset
    from nanoflash.parallel import planner
    tc, par = cfg.train, cfg.parallel
    mcfg = run_preset(cfg)
    argv = ["--preset", tc.preset, "--pp", str(par.pp), "--ep", str(par.ep), "--dp", str(par.dp or 1),
            "--micro-batch-tokens", str(par.micro_batch_tokens), "--gpus-per-host", str(gpus_per_node)]
    argv += ["--recompute"] * par.recompute + ["--offload"] * par.offload_optimizer
    with contextlib.redirect_stdout(io.StringIO()):
        plan = planner.main(argv)
    n_train = par.pp * par.ep * (par.dp or 1)
    w, w_push = rollout_weight_bytes(mcfg), rollout_weight_bytes(mcfg, push=True)
    lines = [f"dry run: {tc.preset} | trainer {n_train} GPUs = PP{par.pp} x EP{par.ep} x DP{par.dp or 1} (TP1) on "
             f"{-(-n_train // gpus_per_node)} node(s) | rollout: {rollout_nodes} node(s) x {gpus_per_node} GPUs "
             f"serving SGLang", "", "trainer, per GPU (parallel.planner):", plan, "",
             f"rollout, per engine: release weights {w / 2**30:.1f} GiB (FP8 linears, FP4 experts) -> "
             f"{w / gpus_per_node / 2**30:.1f} GiB per GPU at TP/EP {gpus_per_node}; the rest is KV cache "
             f"(SGLang --mem-fraction-static)",
             f"weight sync per step: {w_push / 2**30:.1f} GiB (FP8 blocks, experts re-packed FP8, no MTP) "
             f"to each of {rollout_nodes} engines in {cfg.rollout.bucket_bytes / 2**30:.2f} GiB buckets"]
    return "\n".join(lines)

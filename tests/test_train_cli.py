"""train.py's command line (nanoflash/cli.py) and its --dry-run memory plan.

Run: `pytest tests/test_train_cli.py -q`.
"""
import pytest

from nanoflash import cli
from nanoflash.config import RunConfig
from nanoflash.parallel import planner


def test_override_types_and_precedence():
    cfg = cli.parse_args(["--recipe", "demo", "--grpo.clip_high", "0.3", "--rollout.urls=http://a:1,http://b:2",
                          "--grpo.clip_c", "none", "--train.resume", "false", "--steps", "7", "--model.dim", "32",
                          "--parallel.pp", "2", "--parallel.layer_split", "1,3", "--dry-run"])
    assert cfg.grpo.clip_high == 0.3 and isinstance(cfg.grpo.clip_high, float)
    assert cfg.rollout.urls == ("http://a:1", "http://b:2")
    assert cfg.grpo.clip_c is None and cfg.train.resume is False and cfg.train.dry_run is True
    assert cfg.train.steps == 7                      # command line beats the recipe's train.steps
    assert cfg.optim.lr == 1e-3                      # the recipe beats the default
    assert cfg.model == {"vocab_size": 18, "max_seq_len": 32, "dim": 32}
    assert cfg.parallel.layer_split == (1, 3)        # re-validated: the strings became ints


def test_defaults_are_the_miles_recipe():
    cfg = cli.parse_args([])
    assert (cfg.grpo.clip_low, cfg.grpo.clip_high, cfg.optim.lr) == (0.2, 0.28, 1e-6)
    assert cli.parse_args(["--grpo.clip_low=0.1"]).grpo.clip_low == 0.1


@pytest.mark.parametrize("argv, culprit", [
    (["--nosuch.x", "1"], "nosuch"),
    (["--grpo.nosuch", "1"], "nosuch"),
    (["--grpo.n_prompts", "many"], "many"),
    (["--train.resume", "maybe"], "maybe"),
    (["--model.nosuch", "1"], "nosuch"),
    (["--recipe", "nosuch"], "nosuch"),
    (["--grpo.aggregation", "median"], "median"),            # caught by GRPOConfig.__post_init__ after parsing
    (["--rollout.weights", "fp4"], "fp4"),
    (["--rollout.transport", "local", "--rollout.urls", "http://h:30000"], "transport=local"),  # in-process only
    (["--rollout.max_server_restarts", "-1"], "max_server_restarts"),
    (["--steps"], "--steps"),
    (["stray"], "stray"),
])
def test_bad_overrides_name_the_culprit(argv, culprit):
    with pytest.raises(ValueError, match=culprit):
        cli.parse_args(argv)


@pytest.mark.parametrize("recipe", ["demo", "smoke"])
def test_demo_task_holds_out_500_unseen_problems(recipe):
    """Issue 5's bar: the demo evaluates >= 500 held-out problems, none of them in the training stream; the
    CI smoke runs the same task family."""
    from nanoflash.rl import collector
    cfg = cli.parse_args(["--recipe", recipe])
    task = collector.make_task(cfg.train, cli.parse_args(["--recipe", "demo"]).eval, 18)
    held, train = {p.prompt for p in task.heldout}, {p.prompt for p in task.train}
    assert len(held) == len(task.heldout) >= 500 and not held & train
    assert all(len(p.answer) == 1 for p in task.heldout[:50])      # one-token answers (mod10 family)


def test_arith_family_typo_names_the_culprit():
    from nanoflash.rl import collector
    cfg = cli.parse_args(["--recipe", "demo", "--train.data", "arith:mod7"])
    with pytest.raises(ValueError, match="arith:mod7"):
        collector.make_task(cfg.train, cfg.eval, 18)


def test_to_dict_round_trips_through_json():
    d = cli.to_dict(cli.parse_args(["--recipe", "smoke"]))
    assert set(d) == {f for f in RunConfig.__dataclass_fields__}
    assert d["train"]["steps"] == 3


def test_dry_run_plans_the_flash_layout(monkeypatch):
    """The reference trainer layout: V4-Flash at PP4 x EP4 (16 GPUs, 2 nodes). The activation fit is stubbed
    (measuring it needs a flash Block forward, ~80 s on CPU); parameter bytes come from the meta model."""
    monkeypatch.setattr(planner, "MEASURED_FLASH", {0: (1.0e6, 10.0), 4: (1.0e6, 10.0), 128: (1.0e6, 10.0)})
    cfg = cli.parse_args(["--recipe", "flash", "--dry-run"])
    text = cli.dry_run_text(cfg)
    assert "PP4 x EP4 x DP1 (TP1)" in text and "2 node(s) x 8 GPUs serving SGLang" in text
    gpu_table = text.split("GPU per rank", 1)[1].split("host per rank", 1)[0]   # the planner's per-GPU rows
    rows = [ln.split() for ln in gpu_table.splitlines() if ln[:3].strip().isdigit()]
    assert sorted((int(r[0]), int(r[1])) for r in rows) == [(p, e) for p in range(4) for e in range(4)]
    params_per_rank = [float(r[2]) for r in rows]
    assert all(15 < p < 25 for p in params_per_rank), params_per_rank  # ~284B / 16 ranks, experts dominate
    assert "release weights" in text
    # Bug caught (issue 40): the headers were term names cut to 7 letters ("optimiz", "imbalan", "opt_ste") and
    # nothing said what a column counts: every header of both tables is named in the legend under it.
    for table, nxt in (("GPU per rank", "host per rank"), ("host per rank", "max per GPU")):
        block = text.split(table, 1)[1].split(nxt, 1)[0]
        header = next(ln.split() for ln in block.splitlines() if ln.split()[:2] == ["pp", "ep"])
        legend = " ".join(block.split("columns: ", 1)[1].split())
        named = {part.split(" = ")[0] for part in legend.split("; ")}
        assert set(header[2:]) <= named, (header, named)


def test_rollout_weight_bytes_counts_release_storage():
    """FP4 experts count half a byte, FP8 linears one: the tiny model's bytes follow storage_kind exactly."""
    from nanoflash.names import storage_kind
    from nanoflash.config import preset
    from nanoflash.model import Transformer
    cfg = preset("tiny")
    sd = Transformer(cfg).state_dict()
    naive = 0.0
    for name, t in sd.items():
        naive += t.numel() * {"fp8": 1, "fp4": 0.5, "bf16": 2, "fp32": 4, "int64": 8}[storage_kind(name, cfg)]
    assert planner.rollout_weight_bytes(cfg) == naive

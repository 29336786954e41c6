"""`python -m nanoflash.export`: a training checkpoint (DCP, model config inside) -> HF-layout directory, read back
by `load_hf_checkpoint` (tensor for tensor equal to the checkpoint at the stored precision) and by transformers'
`DeepseekV4ForCausalLM.from_pretrained` (same logits).

Run: `pytest tests/test_export.py -q`.
"""
import dataclasses
import json
import os

import pytest
import torch

from nanoflash import export
from nanoflash.rl import trainer
from nanoflash.checkpoint import load_hf_checkpoint
from nanoflash.names import release_kind
from nanoflash.cli import parse_args, to_dict
from nanoflash.config import ModelConfig, preset
from nanoflash.model import Transformer
from nanoflash.parallel.dcp import save_checkpoint
from nanoflash.parallel.dims import ParallelDims

# transformers vs nanoflash on the same fp32 weights: association order only (tests/test_hf_parity.py measures
# ~1e-7 and uses the same bound)
PARITY_TOL = 1e-4
BF16_KINDS = ("fp8", "fp4", "bf16")  # stored BF16 by `--weights bf16`; the fp32 kinds stay FP32, int64 exact


def make_run(run_dir: str, with_model_config: bool = True, seed: int = 3, extra=()):
    """A run directory as train.py leaves it: config.json and one committed checkpoint (model + optimizer)."""
    cfg = parse_args(["--recipe", "smoke", "--out", run_dir, "--model.n_mtp_layers", "0",
                      "--model.compress_ratios", "0,4,8,4", *extra])
    mcfg = preset("tiny", **cfg.model)
    model = trainer.build_model(mcfg, ParallelDims(), cfg.parallel, torch.float32, "cpu", seed=seed)
    opt = trainer.make_optimizer(model, cfg.optim)
    extra = {"data_pos": 0, **({"model_config": dataclasses.asdict(mcfg)} if with_model_config else {})}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f)
    save_checkpoint(os.path.join(run_dir, "checkpoints"), 5, model, opt, ParallelDims(), extra=extra)
    return mcfg, model


@pytest.mark.parametrize("with_model_config", [True, False])   # False: an older checkpoint -> the run's config.json
def test_export_then_load_round_trip_equal(tmp_path, with_model_config):
    mcfg, model = make_run(str(tmp_path / "run"), with_model_config)
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    stored = dataclasses.replace(mcfg, dtype="bf16", expert_dtype="bf16")  # the storage fields say how it was written
    assert ModelConfig.from_hf_config(str(tmp_path / "hf")) == stored        # the rest travels along exactly
    back = Transformer(ModelConfig.from_hf_config(str(tmp_path / "hf")))
    info = load_hf_checkpoint(back, str(tmp_path / "hf"))
    assert info["skipped"] == 0
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for name, t in want.items():
        expect = t.to(torch.bfloat16).to(t.dtype) if release_kind(name) in BF16_KINDS else t
        assert torch.equal(got[name], expect), name


def test_export_is_read_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    make_run(str(tmp_path / "run"))
    assert export.main([str(tmp_path / "run" / "checkpoints" / "step_00000005"), str(tmp_path / "hf")]) == 0
    ours = Transformer(ModelConfig.from_hf_config(str(tmp_path / "hf")))
    load_hf_checkpoint(ours, str(tmp_path / "hf"))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, 18, (2, 15), generator=torch.Generator().manual_seed(0))  # < 16 tokens: every C4 entry kept
    with torch.no_grad():
        diff = (ours.eval()(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff < PARITY_TOL, diff


@pytest.mark.parametrize("source, says", [("missing", "neither a checkpoint"), ("run", "not empty")])
def test_export_errors_are_one_line_exit_2(tmp_path, capsys, source, says):
    make_run(str(tmp_path / "run"))
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("taken")
    assert export.main([str(tmp_path / source), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_export_of_the_demo_task_carries_its_tokenizer_and_generate_stops_at_eos(tmp_path, capsys):
    """Bug caught (issue 40): the export wrote DeepSeek-V4's bos 0 / eos 1 into config.json whatever the run's task,
    and no tokenizer: on the demo's model (<eos> = id 2) transformers' `generate` never stopped ("3259+1=" ->
    [3, 2, 2, 2, 2, 2]), and nothing said how to turn ids into text. The run: the smoke recipe's warm start
    (the demo's task, 20 SFT steps), exported as a user would."""
    import subprocess
    import sys
    transformers = pytest.importorskip("transformers")
    from nanoflash.rl import collector
    from nanoflash.rl.data import CharTokenizer, Problem
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run, out = tmp_path / "run", tmp_path / "hf"
    p = subprocess.run([sys.executable, "train.py", "--recipe", "smoke", "--steps", "0", "--eval.every", "0",
                        "--train.plots", "false", "--train.progress", "false", "--out", str(run)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert export.main([str(run), str(out)]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("tokenizer: the arithmetic task's own, synthetic (18 ids") and "eos 2" in said, said
    char = CharTokenizer()
    with open(out / "config.json") as f:
        hf_cfg = json.load(f)
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (1, 2, 0)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    cfg = parse_args(["--recipe", "smoke"])
    task = collector.make_task(cfg.train, cfg.eval, 18)
    for prob in task.heldout[:3] + [Problem("", "12 - 3*4=", "")]:
        assert tok(prob.prompt)["input_ids"] == char.encode_prompt(prob)             # the task's own ids
    assert tok.decode([1, 5, 6, 13, 2], skip_special_tokens=True) == char.decode([1, 5, 6, 13, 2]) == "23+"
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = Transformer(ModelConfig.from_hf_config(str(out)))
    load_hf_checkpoint(ours, str(out))
    ours.eval()
    stopped = 0
    for prob in task.heldout[:8]:
        ids = torch.tensor([task.encode(prob)])
        gen = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        greedy = []                                                                  # nanoflash's own greedy decode
        with torch.no_grad():
            while len(greedy) < 6 and (not greedy or greedy[-1] != char.eos_id):
                greedy.append(int(ours(torch.tensor([task.encode(prob) + greedy]))[0, -1].argmax()))
        assert gen == greedy, (prob.prompt, gen, greedy)
        stopped += gen[-1] == char.eos_id and len(gen) < 6
    assert stopped == 8                                      # every answer: a digit, then <eos>, and generate stops


@pytest.mark.parametrize("vocab, says", [("129280", "tokenizer: DeepSeek-V4's (129,280 ids), copied; bos 0, eos 1"),
                                         ("18", "tokenizer: not written (the task's 129280 ids do not fit")])
def test_export_of_a_chat_run_carries_the_v4_tokenizer(tmp_path, capsys, vocab, says):
    """A task=chat run's export: DeepSeek-V4's tokenizer files beside the weights, its ids in config.json; a model
    whose vocabulary cannot hold them says so instead of writing a tokenizer that does not fit."""
    transformers = pytest.importorskip("transformers")
    make_run(str(tmp_path / "run"), extra=["--train.task", "chat", "--model.vocab_size", vocab])
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(says)
    if vocab == "18":
        assert not (tmp_path / "hf" / "tokenizer.json").exists()
        return
    with open(tmp_path / "hf" / "config.json") as f:
        hf_cfg = json.load(f)
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (0, 1, 1)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.eos_token_id == 1 and len(tok) == 129280

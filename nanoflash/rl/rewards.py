"""Verifiable rewards: answer extraction, math equivalence in a killable process pool, exact integer match.

Reward of one response y to a problem with reference answer a (Miles' DeepSeek-V4 recipe, `--rm-type math`):

    r(y, a) = REWARD_CORRECT (1)  if extract(y) is equivalent to a
              REWARD_WRONG   (0)  otherwise (no answer found, wrong, or the checker timed out / crashed)

`extract(y)`: look at the text after the last `</think>` when there is one (else the whole response), then take
whichever comes *last* of (a) the last complete `\\boxed{...}` (nested braces and `\\{ \\}` handled) and (b) the
last `Answer: ...` line (`**Answer:**`, `$...$` and a trailing period stripped; a `\\boxed{}` inside is unwrapped).
Reading both removes the `\\boxed{}` vs `Answer:` trap of `docs/rl_notes.md` §6.2: the DAPO prompt asks for an
`Answer:` line, the AIME / MATH-500 prompts ask for `\\boxed{}`.

Equivalence: when the reference and the prediction are both plain integers (all of DAPO and AIME) they are
compared exactly in this process, as digit strings (sign and leading zeros normalised; never `int()`, which
refuses more than 4,300 digits), so float-artifact answers such as `105263157894736848` are taken literally.
Anything else goes to `math-verify` (`parse` + `verify`: LaTeX -> sympy, `\\frac{1}{2}` == `0.5`, tuples,
intervals). math-verify uses `signal.alarm`, which only works in a main thread, so it runs in
`VerifierPool`: a few worker *processes*, each fed one item at a time over a pipe; an item that exceeds
`timeout_s` gets its worker killed and respawned, and scores 0; a worker that dies scores 0 too. Both are
counted (`counts`, logged by the rollout as `reward_*`), nothing hangs. A verifier that cannot start is an
error, not a run of zeros: a missing package at pool creation (ImportError naming it), a worker whose imports
fail at its first item (`VerifierUnavailable` with the worker's message).

Token rewards (`token_reward_fn`): a response holding an id outside the task tokenizer's vocabulary (the model's
vocabulary can be larger) scores 0 without being decoded, counted as `oov`.

The synthetic arithmetic task uses `integer_match` on the whole decoded response.

Reward plug-ins (`--train.reward module:function`): `nanoflash/rl/plugins.py`.

Differs from production: Miles grades with the deepscaler/verl sympy grader (`grade_answer_mathd` or
`grade_answer_sympy`) on the last `\\boxed{}` only, without a process pool; DAPO's own reward reads the
`Answer:` line and pays +1/-1. We pay 1/0 like Miles' V4 recipe.

Tests: `pytest tests/test_rewards.py -q`.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Sequence

REWARD_CORRECT = 1.0   # Miles `--rm-type math`: 1 if correct
REWARD_WRONG = 0.0     # ... else 0 (DAPO's own `compute_score` would use -1)
DEFAULT_TIMEOUT_S = 10.0  # per item; math-verify's own parse/verify alarms are 5 s each, so 10 s is their sum

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_RE = re.compile(r"(?i)answer[ \t]*\**[ \t]*[:：][ \t]*\**(.*)$", re.MULTILINE)
_INT_RE = re.compile(r"^[+-]?\d+$")


# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------

def _braced(text: str, start: int) -> int | None:
    """Index just past the `}` matching the `{` at `start`, skipping escaped `\\{` `\\}`; None if unbalanced."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _box_at(text: str, m: re.Match) -> str | None:
    j = m.end()
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        end = _braced(text, j)
        return None if end is None else text[j + 1:end - 1].strip()
    token = re.match(r"[^\s$]+", text[j:]) if j > m.end() else None  # `\boxed 5` form
    return token.group(0) if token else None


def last_boxed(text: str) -> tuple[str, int] | None:
    """(content, start offset) of the last complete `\\boxed{...}` / `\\fbox{...}`, or None."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        content = _box_at(text, m)
        if content is not None:
            return content, m.start()
    return None


def _strip_answer(s: str) -> str:
    s = s.strip().strip("*").strip().rstrip(".").strip()
    inner = last_boxed(s)
    if inner is not None:
        return inner[0]
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$").strip()
    return s.rstrip(".").strip()


def answer_line(text: str) -> tuple[str, int] | None:
    """(content, start offset) of the last non-empty `Answer: ...` line, or None."""
    for m in reversed(list(_ANSWER_RE.finditer(text))):
        content = _strip_answer(m.group(1))
        if content:
            return content, m.start()
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the later of the last `\\boxed{}` and the last `Answer:` line."""
    cut = response.rfind("</think>")
    text = response[cut + len("</think>"):] if cut >= 0 else response
    found = [c for c in (last_boxed(text), answer_line(text)) if c is not None]
    if not found:
        return None
    return max(found, key=lambda c: c[1])[0]


def _canonical_int(s: str) -> str:
    """'+007' -> '7', '-0' -> '0', '-012' -> '-12': one spelling per integer, any number of digits."""
    sign, digits = ("-", s[1:]) if s[0] == "-" else ("", s.lstrip("+"))
    digits = digits.lstrip("0") or "0"
    return ("" if digits == "0" else sign) + digits


def integer_match(pred: str | None, gold: str) -> bool:
    """Exact integer equality of two integer strings (`+7` == `7`, `07` == `7`); False if either is not one.
    Compared as digit strings, so 5,000-digit answers work (int() refuses > 4,300 digits)."""
    if pred is None:
        return False
    pred, gold = pred.strip().replace(",", ""), gold.strip()
    return bool(_INT_RE.match(pred) and _INT_RE.match(gold)) and _canonical_int(pred) == _canonical_int(gold)


# ---------------------------------------------------------------------------------------------------------------
# Process pool with per-item timeout
# ---------------------------------------------------------------------------------------------------------------

class VerifierUnavailable(RuntimeError):
    """The verifier's worker processes cannot start (their imports fail): nothing could be scored."""


def _worker_main(read_fd: int, write_fd: int, warm_imports: str) -> None:
    """Worker process main: import once, then answer (job, fn, args) messages until a None arrives. An import
    that fails is answered as (None, False, message) to the first job, and the worker exits."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        for name in filter(None, warm_imports.split(",")):
            __import__(name)
    except Exception as e:  # reported to the parent, which raises VerifierUnavailable
        outbox.send((None, False, f"import failed: {type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the parent exited without close(): leave quietly
            return
        if msg is None:
            return
        job, fn, args = msg
        try:
            outbox.send((job, True, fn(*args)))
        except Exception as e:  # reported to the parent, counted as an error, scored 0
            outbox.send((job, False, f"{type(e).__name__}: {e}"))


def kill_group(proc) -> None:
    """SIGKILL a process started with start_new_session=True and everything still in its group; reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class VerifierPool:
    """`n_workers` processes running `fn(*args)` one item each; an item past `timeout_s` kills its worker.

    Workers are fresh interpreters (`python -c`, talking over two pipes), not fork/spawn children: they import
    only this module and math-verify, never re-run the caller's `__main__` (spawn would) and never inherit the
    trainer's threads or CUDA state (fork would). `fn` must be a module-level function (it is pickled by name).

    `start=False` defers the processes to the first `map` (the ranks of a multi-rank run that never score).
    Shapes: map(fn, [args_0, ..., args_{N-1}]) -> N outcomes `(status, value)`, status in ok|error|timeout|crash.
    """

    def __init__(self, n_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
                 warm_imports: tuple[str, ...] = ("math_verify",), start: bool = True):
        if n_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need n_workers >= 1 and timeout_s > 0, got {n_workers}, {timeout_s}")
        missing = [m for m in warm_imports if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"the answer verifier needs {missing}, which is not installed (pip install "
                              f"{' '.join(m.replace('_', '-') for m in missing)})")
        self.timeout_s, self.warm_imports = timeout_s, ",".join(warm_imports)
        self.counts, self.n_workers = collections.Counter(), n_workers
        self._workers = []  # (process, inbox, outbox) per worker
        if start:  # else at the first map: a rank that never scores (all but rank 0) starts no process
            self.start()

    def start(self) -> None:
        """Start the worker processes (once)."""
        if not self._workers:
            self._workers = [self._spawn() for _ in range(self.n_workers)]

    def _spawn(self):
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "   # Ctrl-C is the trainer's to handle
                f"from nanoflash.rl.rewards import _worker_main; "
                f"_worker_main({to_child_r}, {to_parent_w}, {self.warm_imports!r})")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child_r, to_parent_w), env=env,
                                start_new_session=True)   # its own group: a kill takes the plug-in's children too
        os.close(to_child_r)
        os.close(to_parent_w)
        return proc, Connection(to_parent_r, writable=False), Connection(to_child_w, readable=False)

    def _replace(self, w: int) -> None:
        proc, inbox, outbox = self._workers[w]
        kill_group(proc)
        inbox.close()
        outbox.close()
        self._workers[w] = self._spawn()

    def _send(self, w: int, msg) -> None:
        """Hand worker w a job; one that died while idle is replaced once, unless it left a start-up failure."""
        for attempt in range(2):
            try:
                return self._workers[w][2].send(msg)
            except (BrokenPipeError, OSError):
                try:
                    note = self._workers[w][1].recv() if self._workers[w][1].poll(0) else None
                except (EOFError, OSError):
                    note = None
                if (note and note[0] is None) or attempt:
                    raise VerifierUnavailable(f"verifier worker cannot start: {note[2] if note else 'it exits'}")
                self._replace(w)

    def map(self, fn: Callable, arg_list: Sequence[tuple]) -> list[tuple[str, Any]]:
        self.start()
        out: list[tuple[str, Any]] = [("pending", None)] * len(arg_list)
        todo = collections.deque(range(len(arg_list)))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (job, deadline)
        while todo or busy:
            for w in range(len(self._workers)):
                if w not in busy and todo:
                    job = todo.popleft()
                    self._send(w, (job, fn, tuple(arg_list[job])))
                    busy[w] = (job, time.monotonic() + self.timeout_s)
            next_deadline = min(d for _, d in busy.values())
            conns = {self._workers[w][1]: w for w in busy}
            for conn in mp_wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())):
                w = conns[conn]
                job = busy.pop(w)[0]
                try:
                    done, ok, value = conn.recv()
                    if done is None:  # the worker's imports failed: every item would score 0
                        self._replace(w)
                        raise VerifierUnavailable(f"verifier worker cannot start: {value}")
                    out[job] = ("ok", value) if ok else ("error", value)
                except (EOFError, OSError):
                    out[job] = ("crash", None)
                    self._replace(w)
                self.counts[out[job][0]] += 1
            now = time.monotonic()
            for w, (job, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(w)
                    out[job] = ("timeout", None)
                    self.counts["timeout"] += 1
                    self._replace(w)
        return out

    def close(self) -> None:
        for _, _, outbox in self._workers:
            try:
                outbox.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, inbox, outbox in self._workers:
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc)   # the worker, if it did not leave, and whatever it started that is still there
            inbox.close()
            outbox.close()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------

def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify equivalence of two answer strings (each parsed as the content of a `\\boxed{}`)."""
    from math_verify import parse, verify
    g, p = parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")
    return bool(g and p and verify(g, p))


class MathReward:
    """r = 1 if extract_answer(response) is equivalent to the reference, else 0; see the module docstring.

    Shapes: __call__(responses [N] str, answers [N] str) -> [N] float. `counts` tallies how each was decided.
    """

    def __init__(self, pool: VerifierPool | None = None, n_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify_fn: Callable[[str, str], bool] = None, start: bool = True):
        self.verify_fn = verify_fn or math_verify_equal  # a top-level function (it is pickled to the workers)
        self._own_pool = pool is None
        self.pool = pool or VerifierPool(n_workers=n_workers, timeout_s=timeout_s, start=start)
        self.counts = collections.Counter()

    def __call__(self, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        preds = [extract_answer(r) for r in responses]
        correct = [False] * len(preds)
        slow = []
        for i, (p, g) in enumerate(zip(preds, answers)):
            if p is None:
                self.counts["no_answer"] += 1
            elif _INT_RE.match(g.strip()) and _INT_RE.match(p.strip().replace(",", "")):
                correct[i] = integer_match(p, g)
                self.counts["integer"] += 1
            else:
                slow.append(i)
        for i, (status, value) in zip(slow, self.pool.map(self.verify_fn, [(preds[i], answers[i]) for i in slow])):
            self.counts["verify_" + status] += 1
            correct[i] = status == "ok" and bool(value)
        return [REWARD_CORRECT if c else REWARD_WRONG for c in correct]

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()


_DEFAULT_REWARD: MathReward | None = None


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's answer (the last `\\boxed{}`, else the last `Answer:` line) equals `answer` (exact
    integers, else math-verify in a worker process with a timeout), 0.0 otherwise. One shared pool per process."""
    global _DEFAULT_REWARD
    if _DEFAULT_REWARD is None:
        _DEFAULT_REWARD = MathReward()
    return _DEFAULT_REWARD([response], [answer])[0]


def arith_reward(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Synthetic task: 1 if the whole (stripped) response is the reference integer, else 0."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    return [REWARD_CORRECT if integer_match(r, a) else REWARD_WRONG for r, a in zip(responses, answers)]


class TokenReward:
    """A text reward `(responses, answers) -> rewards` as `(problems, token-id lists) -> rewards`.

    A response with an id outside [0, vocab_size) (the task tokenizer's vocabulary; None = no check) scores
    REWARD_WRONG undecoded. `counts`: "oov" plus the text reward's own counts (MathReward: no_answer, integer,
    verify_ok|error|timeout|crash), cumulative.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], text_reward: Callable, vocab_size: int | None = None):
        self.decode, self.text_reward, self.vocab_size = decode, text_reward, vocab_size
        self.own = collections.Counter()

    @property
    def counts(self) -> collections.Counter:
        return self.own + collections.Counter(getattr(self.text_reward, "counts", {}))

    def __call__(self, problems, responses_ids) -> list[float]:
        V = self.vocab_size
        ok = [V is None or all(0 <= int(t) < V for t in ids) for ids in responses_ids]
        self.own["oov"] += ok.count(False)
        keep = [i for i, good in enumerate(ok) if good]
        scored = self.text_reward([self.decode(responses_ids[i]) for i in keep], [problems[i].answer for i in keep])
        out = [REWARD_WRONG] * len(ok)
        for i, r in zip(keep, scored):
            out[i] = r
        return out


def token_reward_fn(decode: Callable[[Sequence[int]], str], text_reward: Callable,
                    vocab_size: int | None = None) -> TokenReward:
    """Adapt a text reward `(responses, answers) -> rewards` to `(problems, token-id lists) -> rewards`."""
    return TokenReward(decode, text_reward, vocab_size)


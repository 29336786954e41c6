"""Run logging: one JSON line per event in `out_dir/metrics.jsonl`, plus optional TensorBoard / W&B and tqdm.

Every record is `{"kind": "train"|"eval"|"warmup"|"info", "step": N, ...numbers}`. The JSONL file is the
source of truth (plots and tests read it back with `read_jsonl`); TensorBoard and W&B receive the same
numbers as `<kind>/<name>` when installed and asked for, and are skipped with one printed note otherwise.

Resume: `MetricsLog(path, resume_step=N)` first drops every record with step > N (they belong to steps the
crashed run finished after its last checkpoint and that the resumed run will redo), so the file never holds
two records of one step. The mirrors follow the same rule: TensorBoard's writer opens with
`purge_step = N + 1` (TensorBoard then discards the events of steps > N that the crashed run wrote), and W&B
resumes the *same* run: its id is drawn once and kept in `out_dir/wandb_run_id`, and every later start calls
`wandb.init(id=..., resume="allow")`, so a resumed run continues one W&B run instead of opening a new one.
W&B ignores steps at or below the last one it holds, so a redone step keeps the crashed run's record there
(the resumed run redraws it bit for bit; only its timings differ).

Differs from Miles: Miles logs to W&B / TensorBoard through Ray actors; here rank 0 writes a flat file.

Tests: `pytest tests/test_metrics_log.py tests/test_train_e2e.py -q`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import uuid

import torch

from nanoflash.grpo import Episode, filter_groups


def read_jsonl(path: str, kind: str | None = None) -> list[dict]:
    """Records of `path` (optionally only one kind). A torn last line (no newline: a crash mid-write) is dropped
    with a warning; a corrupt line anywhere else is an error naming it."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        lines = f.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not line.endswith("\n"):
                print(f"warning: {path}:{i}: dropped a torn last line (a crash mid-write): {line[:80]!r}",
                      file=sys.stderr)
                continue
            raise ValueError(f"{path}:{i}: not a JSON line ({e}): {line[:80]!r}") from e
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def _clean(v):
    """Tensors / numpy scalars -> float; NaN/inf -> None (JSON has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def wandb_run_id(run_dir: str, fresh: bool) -> str:
    """The W&B run id of `run_dir`: a fresh run draws one (kept in `wandb_run_id`), a resumed run reads it back."""
    path = os.path.join(run_dir, "wandb_run_id")
    if not fresh and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


class MetricsLog:
    """Append-only JSONL log with optional TensorBoard / W&B mirrors (rank 0 only; others pass enabled=False)."""

    def __init__(self, path: str, resume_step: int | None = None, tensorboard: bool = False, wandb: str = "",
                 config: dict | None = None, enabled: bool = True):
        self.path, self.enabled, self.tb, self.wb = path, enabled, None, None
        if not enabled:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        keep = [r for r in read_jsonl(path) if resume_step is not None and r.get("step", 0) <= resume_step]
        with open(path, "w") as f:  # rewrite: a fresh run starts empty, a resumed one keeps steps <= N
            for r in keep:
                f.write(json.dumps(r) + "\n")
        run_dir = os.path.dirname(path) or "."
        purge = None if resume_step is None else resume_step + 1  # drop the redone steps' old events
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=purge)
            except ImportError:
                print("metrics: tensorboard is not installed; logging to JSONL only", file=sys.stderr)
        if wandb:
            try:
                import wandb as wb
                self.wb = wb.init(project=wandb, id=wandb_run_id(run_dir, fresh=resume_step is None),
                                  config=config or {}, resume="allow")
            except ImportError:
                print("metrics: wandb is not installed; logging to JSONL only", file=sys.stderr)

    def log(self, kind: str, step: int, values: dict) -> dict:
        rec = {"kind": kind, "step": int(step), **{k: _clean(v) for k, v in values.items()}}
        if not self.enabled:
            return rec
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        nums = {f"{kind}/{k}": v for k, v in rec.items() if isinstance(v, (int, float)) and k not in ("step",)}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(nums, step=step)
        return rec

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


@torch.no_grad()
def answer_probe(model, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0) -> dict:
    """What the policy puts on the reference responses y (answer + stop token), by teacher forcing:

        p_i      = prod_t softmax(f(x_i, y_<t) / T)[y_t]        the probability of sampling y_i exactly
        greedy_i = [argmax_v f(x_i, y_<t)[v] == y_t for every t]  greedy decoding reproduces y_i exactly

    Rows of equal prompt and response length go through one forward. Returns {"greedy_accuracy",
    "p_right_mean", "p_right_se"} (means over the problems; se = std / sqrt(P)). Shapes: prompts and
    responses P lists of ids; each forward [b, P_i + R_i - 1] -> logits [b, S, V]."""
    p_right, greedy = torch.zeros(len(prompts), dtype=torch.float64), torch.zeros(len(prompts), dtype=torch.bool)
    groups: dict = {}
    for i, (x, y) in enumerate(zip(prompts, responses)):
        groups.setdefault((len(x), len(y)), []).append(i)
    dev = next(model.parameters()).device
    for (P, R), idx in groups.items():
        seq = torch.tensor([prompts[i] + responses[i] for i in idx], device=dev)        # [b, P + R]
        logits = model(seq[:, :-1])[:, P - 1:].float() / temperature                 # [b, R, V]: predicts y
        y = seq[:, P:]                                                               # [b, R]
        lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]          # [b, R]
        p_right[idx] = lp.sum(-1).exp().double().cpu()
        greedy[idx] = (logits.argmax(-1) == y).all(-1).cpu()
    n = len(prompts)
    return {"greedy_accuracy": float(greedy.double().mean()), "p_right_mean": float(p_right.mean()),
            "p_right_se": float(p_right.std() / n ** 0.5) if n > 1 else 0.0}


class _NoBar:
    def __init__(self, total=None, **_):
        self.total = total

    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def write(self, line: str):
        print(line, flush=True)

    def close(self):
        pass


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar (to stderr, cleared when closed) when tqdm is installed and `enabled`, else a no-op object.
    Either one's `write(line)` prints a line to stdout (above the bar, which tqdm redraws)."""
    if enabled:
        try:
            from tqdm import tqdm
            bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
            bar.write = lambda line: tqdm.write(line, file=sys.stdout)
            return bar
        except ImportError:
            pass
    return _NoBar(total=total)


def step_metrics(episodes: list[Episode], group_size: int | None = None) -> dict[str, float]:
    """Rollout-side numbers to log each step (means over episodes; response length in tokens).
        reward_mean, reward_std (population), response_len_mean / _max, prompt_len_mean, truncated_frac
        (finish_reason "length"), aborted_frac, rollout_logprob_mean (per token), n_episodes, and with
        group_size: zero_std_group_frac, the share of groups that dynamic sampling would drop.
    """
    if not episodes:
        raise ValueError("step_metrics: no episodes")
    r = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    R = torch.tensor([len(e.response_ids) for e in episodes], dtype=torch.float64)
    out = {
        "reward_mean": float(r.mean()), "reward_std": float(r.std(unbiased=False)),
        "response_len_mean": float(R.mean()), "response_len_max": float(R.max()),
        "prompt_len_mean": sum(len(e.prompt_ids) for e in episodes) / len(episodes),
        "truncated_frac": sum(e.truncated for e in episodes) / len(episodes),
        "aborted_frac": sum(e.finish_reason == "abort" for e in episodes) / len(episodes),
        "rollout_logprob_mean": sum(sum(e.rollout_logprobs) for e in episodes) / float(R.sum()),
        "n_episodes": float(len(episodes)),
    }
    if group_size is not None:
        n_groups = len({e.group_id for e in episodes})
        out["zero_std_group_frac"] = 1.0 - len(filter_groups(episodes, group_size)) / group_size / n_groups
    return out

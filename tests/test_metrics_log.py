"""A resumed run logs each step once: JSONL (stale records dropped), TensorBoard (`purge_step`) and W&B (the same
run id, `resume="allow"`). TensorBoard and W&B are replaced by small fakes that keep their documented
semantics (a writer opened with purge_step=p discards earlier events of steps >= p; a W&B run resumed by id
ignores steps at or below its last one), so the test needs neither installed.

Run: `pytest tests/test_metrics_log.py -q`.
"""
import os
import sys
import types

import pytest

from nanoflash.rl.metrics import MetricsLog, read_jsonl


class FakeTB:
    store: dict = {}   # log_dir -> [(tag, step, value)], what TensorBoard would display

    def __init__(self, log_dir, purge_step=None):
        events = FakeTB.store.setdefault(log_dir, [])
        if purge_step is not None:
            events[:] = [e for e in events if e[1] < purge_step]
        self.events = events

    def add_scalar(self, tag, value, step):
        self.events.append((tag, step, value))

    def flush(self):
        pass

    def close(self):
        pass


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.runs, self.inits = {}, []   # id -> {step: values}; every init call's kwargs

    def init(self, project, id, config, resume):
        self.inits.append({"project": project, "id": id, "resume": resume})
        history = self.runs.setdefault(id, {})

        class Run:
            def log(_, values, step):
                if not history or step > max(history):   # W&B drops non-increasing steps of a resumed run
                    history[step] = values

            def finish(_):
                pass
        return Run()


@pytest.fixture()
def fakes(monkeypatch):
    wb = FakeWandb()
    tb_mod = types.ModuleType("torch.utils.tensorboard")
    tb_mod.SummaryWriter = FakeTB
    monkeypatch.setitem(sys.modules, "wandb", wb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb_mod)
    FakeTB.store = {}
    return wb


def test_resumed_run_logs_each_step_once_everywhere(tmp_path, fakes):
    path = str(tmp_path / "metrics.jsonl")
    first = MetricsLog(path, tensorboard=True, wandb="proj")
    for step in (1, 2, 3):                                  # the crashed run: checkpoint 2, then step 3, then kill
        first.log("train", step, {"reward_mean": step / 10})
    again = MetricsLog(path, resume_step=2, tensorboard=True, wandb="proj")
    for step in (3, 4):                                     # the resumed run redoes step 3
        again.log("train", step, {"reward_mean": step / 10 + 0.5})
    again.close()
    assert [(r["step"], r["reward_mean"]) for r in read_jsonl(path, "train")] == [(1, .1), (2, .2), (3, .8), (4, .9)]
    (events,) = FakeTB.store.values()
    assert [(s, v) for tag, s, v in events if tag == "train/reward_mean"] == [(1, .1), (2, .2), (3, .8), (4, .9)]
    ids = {i["id"] for i in fakes.inits}
    assert len(fakes.inits) == 2 and len(ids) == 1 and all(i["resume"] == "allow" for i in fakes.inits)
    assert sorted(fakes.runs[ids.pop()]) == [1, 2, 3, 4]   # one W&B run, each step once
    with open(tmp_path / "wandb_run_id") as f:
        assert f.read().strip() in fakes.runs


def test_fresh_run_in_the_same_directory_gets_a_new_wandb_run(tmp_path, fakes):
    path = str(tmp_path / "metrics.jsonl")
    MetricsLog(path, wandb="proj").log("train", 1, {"x": 1.0})
    MetricsLog(path, wandb="proj").log("train", 1, {"x": 2.0})   # resume_step=None: a new run
    assert len({i["id"] for i in fakes.inits}) == 2
    assert os.path.exists(tmp_path / "wandb_run_id")

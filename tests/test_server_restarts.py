"""The one restart policy of the loop (`nanoflash/rl/restarts.py`) with fakes: a rollout, an eval and a push
that meet a lost server all wait for its /health up to `rollout.health_timeout_s`, re-push the last weights on
re-created groups and redo what failed, within `rollout.max_server_restarts`; past it, one line.

Issue 39 case 5. Bugs caught: a server death during the eval ending the run (the eval had its own one-line
stop), a push giving up after the client's `retry_s` without waiting for the server, a restart that does not
re-push before redoing (scored on the restarted server's initial weights), a budget that is not shared by the
three. The real run is `tests/test_train_e2e.py::test_a_server_that_dies_mid_run_is_waited_for_and_re_pushed`.
Run: pytest tests/test_server_restarts.py -q
"""
import pytest

from nanoflash.config import RolloutConfig
from nanoflash.parallel.dims import ParallelDims
from nanoflash.rl.collector import StaleServerError
from nanoflash.rl.restarts import ServerRestarts
from nanoflash.sglang.client import RequestRejected, ServerGoneError
from nanoflash.sglang.transports import PushFailed

HEALTH_S = 77.0   # a value no other timeout of the config has: the wait must be this one


class FakeClient:
    def __init__(self, back: bool = True):
        self.waits, self.back = [], back

    def wait_healthy(self, timeout):
        self.waits.append(timeout)
        if not self.back:
            raise ServerGoneError(f"servers not healthy after {timeout}s: ['http://r0:30000']")


class FakePusher:
    """`fail`: how many pushes in a row raise PushFailed (as StagePusher.push does once its retries are spent)."""

    def __init__(self, events, fail: int = 0):
        self.events, self.fail = events, fail

    def push(self, state, version):
        self.events.append(("push", version))
        if self.fail:
            self.fail -= 1
            raise PushFailed("weight push failed after 2 attempt(s); servers left paused: ['http://r0:30000']: "
                             "ServerGoneError: http://r0:30000/pause_generation: server unreachable")
        return {"tensors": 12, "bytes": 345}

    def reconnect(self, restarted=False):
        self.events.append(("reconnect", restarted))


def _policy(budget: int, fail_pushes: int = 0, back: bool = True):
    events, logged = [], []
    rc = RolloutConfig(max_server_restarts=budget, health_timeout_s=HEALTH_S, retry_s=1.0)
    client = FakeClient(back)
    policy = ServerRestarts(rc, ParallelDims(), client, FakePusher(events, fail_pushes),
                            log=lambda kind, step, rec: logged.append((kind, step, rec)))
    return policy, events, client, logged


def _flaky(events, *errors):
    """A rollout / eval that raises each of `errors` once, then answers."""
    left = list(errors)

    def fn():
        events.append("sample")
        if left:
            raise left.pop(0)
        return "result"
    return fn


@pytest.mark.parametrize("where,error", [
    ("eval at step 4", ServerGoneError("http://r0:30000/generate: server unreachable")),
    ("rollout for step 5", StaleServerError("http://r0:30000 generated with weight version 0, but version 4-ab")),
])
def test_a_lost_server_is_waited_for_re_pushed_and_the_work_redone(where, error):
    policy, events, client, logged = _policy(budget=2)
    assert policy.push("weights", 4) == {"tensors": 12, "bytes": 345}
    assert policy.run(where, 4, _flaky(events, error)) == "result"
    # waited for health (not retry_s), forgot the servers, re-pushed the last weights, then redid the work
    assert client.waits == [HEALTH_S]
    assert events == [("push", 4), "sample", ("reconnect", True), ("push", 4), "sample"]
    assert [(k, s, r["during"], r["server_restarts"], r["sync_tensors"]) for k, s, r in logged] == \
        [("server_restart", 4, where, 1, 12)]


def test_a_push_into_a_lost_server_waits_for_it_and_pushes_again():
    policy, events, client, _ = _policy(budget=1, fail_pushes=1)
    assert policy.push("weights", 7)["tensors"] == 12
    assert client.waits == [HEALTH_S]
    assert events == [("push", 7), ("reconnect", True), ("push", 7)]


def test_one_budget_for_rollout_eval_and_push_then_one_line(capsys):
    policy, events, client, _ = _policy(budget=2, fail_pushes=1)
    policy.push("weights", 1)                                              # restart 1 of 2: the push
    policy.run("rollout for step 2", 2, _flaky(events, ServerGoneError("gone")))   # restart 2 of 2: the rollout
    with pytest.raises(SystemExit) as e:                                   # the eval finds the budget used up
        policy.run("eval at step 2", 2, _flaky(events, ServerGoneError("gone again")))
    msg = str(e.value)
    assert msg.startswith("eval at step 2 failed: ServerGoneError: gone again") and "\n" not in msg
    assert "rollout.max_server_restarts=2 used up" in msg and "re-run the same command" in msg
    out = capsys.readouterr().out
    assert "restart 1 of 2" in out and "restart 2 of 2" in out and "weight push v1: weight push failed" in out


def test_no_budget_or_a_server_that_stays_away_stops_with_one_line():
    policy, events, _, _ = _policy(budget=0)
    policy.push("weights", 3)
    with pytest.raises(SystemExit, match=r"^rollout for step 4 failed: ServerGoneError: gone \(rollout."
                                         r"max_server_restarts=0;"):
        policy.run("rollout for step 4", 4, _flaky(events, ServerGoneError("gone")))
    policy, events, _, _ = _policy(budget=1, back=False)
    policy.push("weights", 3)
    with pytest.raises(SystemExit, match=r"rollout.urls: servers not healthy after 77.0s.*health_timeout_s=77"):
        policy.run("eval at step 3", 3, _flaky(events, ServerGoneError("gone")))


def test_other_errors_are_not_restarts():
    """A request the server refuses (4xx: our bug, or a prompt too long) is not a lost server: raised as is."""
    policy, events, client, _ = _policy(budget=3)
    policy.push("weights", 1)
    with pytest.raises(RequestRejected):
        policy.run("eval at step 1", 1, _flaky(events, RequestRejected("http://r0:30000/generate", 400, "bad")))
    assert client.waits == []

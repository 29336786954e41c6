"""Run train.py with its checkpoint writer held, to test asynchronous saves deterministically (never by timing).

    python tests/save_probe.py MODE [train.py arguments]

MODE
    overlap   every save's writer holds until the next step's rollout begins (`Collector.next_batch`, which
              first checks that the writer is running) or the run waits for the save (`Trainer.finish_save`: the
              last one), then writes; each save's step and what released it go to OUT/save_probe.jsonl
    crash:K   the writer of step K writes DCP's shards, touches OUT/save_blocked and holds before its checksums
              and commit, for ever (the test kills the run there)
    plain     train.py as it is

Used by tests/test_checkpoint_async.py; train.py runs in this process (`runpy`), after the patches.
"""
import json
import os
import runpy
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanoflash.parallel import dcp  # noqa: E402
from nanoflash.rl import collector, trainer  # noqa: E402


def _out_dir(argv: list) -> str:
    return argv[argv.index("--out") + 1]


def overlap(out: str) -> None:
    released, waiting, why, expected = threading.Event(), threading.Event(), {}, [False]
    real_write, real_next = dcp._write, collector.Collector.next_batch
    real_save, real_finish = trainer.Trainer.save, trainer.Trainer.finish_save

    def write(root, tmp, final, step, *rest):
        waiting.set()           # the writer is running, and holds
        released.wait(120)
        with open(os.path.join(out, "save_probe.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "released_by": why.get("by")}) + "\n")
        return real_write(root, tmp, final, step, *rest)

    def release(by):
        if not released.is_set():
            why["by"] = by
            released.set()

    def save(self, *a, **k):
        real_save(self, *a, **k)
        expected[0] = self.pending_save is not None

    def next_batch(self, at):
        if expected[0]:   # a save is in flight: its writer must be running (holding) while the rollout starts
            release("rollout" if waiting.wait(10) else "rollout, with no writer running")
        return real_next(self, at)

    def finish_save(self):
        if self.pending_save is not None:
            release("wait")
        path = real_finish(self)
        released.clear()
        waiting.clear()
        why.clear()
        expected[0] = False
        return path
    dcp._write, collector.Collector.next_batch = write, next_batch
    trainer.Trainer.save, trainer.Trainer.finish_save = save, finish_save


def crash(out: str, at: int) -> None:
    """The writer of step `at` holds after DCP's shards and the RNG files are written, before the checksums
    (and so before the commit): a node lost in the middle of a save."""
    real_checksums = dcp._checksums

    def checksums(tmp, dims, group):
        if not os.path.basename(tmp).startswith(f"step_{at:08d}"):   # step_N.tmp (or step_N, were it committed early)
            return real_checksums(tmp, dims, group)
        open(os.path.join(out, "save_blocked"), "w").close()
        threading.Event().wait()
    dcp._checksums = checksums


def main() -> None:
    mode, argv = sys.argv[1], sys.argv[2:]
    out = _out_dir(argv)
    os.makedirs(out, exist_ok=True)
    if mode == "overlap":
        overlap(out)
    elif mode.startswith("crash:"):
        crash(out, int(mode.split(":")[1]))
    elif mode != "plain":
        raise SystemExit(f"unknown mode {mode!r}")
    sys.argv = [os.path.join(ROOT, "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

"""Run train.py with its checkpoint writer held, to test asynchronous saves deterministically (never by timing).

    python tests/save_probe.py MODE [train.py arguments]

MODE
    overlap   every save's writer waits until the next step's rollout has begun (`Collector.next_batch`) or the
              run waits for the save (`Trainer.finish_save`: the last one), then writes; each save's step and
              what released it go to OUT/save_probe.jsonl
    crash:K   the writer of step K writes DCP's shards, touches OUT/save_blocked and never finishes (the test
              kills the run there)
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
    released, why = threading.Event(), {}
    real_write, real_next, real_finish = dcp._write, collector.Collector.next_batch, trainer.Trainer.finish_save

    def write(root, tmp, final, step, *rest):
        released.wait(120)
        with open(os.path.join(out, "save_probe.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "released_by": why.get("by")}) + "\n")
        return real_write(root, tmp, final, step, *rest)

    def release(by):
        if not released.is_set():
            why["by"] = by
            released.set()

    def next_batch(self, at):
        release("rollout")
        return real_next(self, at)

    def finish_save(self):
        if self.pending_save is not None:
            release("wait")
        out_path = real_finish(self)
        released.clear()
        why.clear()
        return out_path
    dcp._write, collector.Collector.next_batch, trainer.Trainer.finish_save = write, next_batch, finish_save


def crash(out: str, at: int) -> None:
    real_write = dcp._write
    real_save = dcp.dcp.save

    def write(root, tmp, final, step, state, *rest):
        if step != at:
            return real_write(root, tmp, final, step, state, *rest)
        real_save(state, checkpoint_id=tmp, no_dist=True)   # the shards are on disk; the rest never happens
        open(os.path.join(out, "save_blocked"), "w").close()
        threading.Event().wait()
    dcp._write = write


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

"""A loop hook that records every call it gets (tests/test_hooks.py runs train.py with it)."""
import json
import os

from nanoflash.rl.hooks import Hook


class Recorder(Hook):
    """Appends one JSON line per call to <train.out_dir>/hook_calls.jsonl; returns a metric per point."""

    name = "recorder"

    def _write(self, **rec) -> None:
        with open(os.path.join(self.ctx.cfg.train.out_dir, "hook_calls.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _weights(self) -> float:
        return float(sum(p.double().sum() for p in self.ctx.trainer.model.parameters()))

    def after_push(self, version):
        self._write(call="after_push", version=version, weights_sum=self._weights())
        return {"recorder_push": version}

    def before_update(self, batch, old, step):
        on = batch.mask > 0   # old: the trainer's log-probs of the weights that sampled the batch (pre-update)
        gap = float((old - batch.rollout_logprobs)[on].abs().mean())
        self._write(call="before_update", step=step, rows=len(batch), gap=gap,
                    weights_sum=self._weights())
        return {"recorder_gap": gap}

    def after_eval(self, at, acc, gen_for):
        self._write(call="after_eval", at=at, problems=len(acc))
        return {"recorder_acc": float(acc.mean())}

    def close(self):
        self._write(call="close")

"""The RL loop's own modules, in the order a step uses them.

    data             problems and prompt ids (DAPO-Math / AIME / MATH-500 loaders, generated rows, V4 chat format)
    collector        the rollout half: servers, dynamic-sampling collection into a packed batch, eval sampling
    rewards, plugins answer checking; a user's own `--train.reward module:function`
    trainer          the training half: `Trainer.step(batch)` -> old log-probs, the GRPO step over the engine
    evaluate         pass@k / avg@n on held-out problems
    restarts         one policy for a server lost during a rollout, an eval or a push (wait, re-push, redo)
    hooks            the one interface instruments attach through (`--train.hooks module:Class`)
    metrics, plots   one JSON line per event and the run's figures

GRPO's math itself is `nanoflash/grpo.py` (pure functions, no loop); the engine is `nanoflash/parallel/`, the
SGLang boundary `nanoflash/sglang/`, nanoflash's own server `nanoflash/server/`.
Tests: `pytest tests/test_trainer.py tests/test_train_e2e.py -q`.
"""

"""The RL loop's own modules, in the order a step uses them.

    data, synth      problems and prompt ids (DAPO-Math / AIME / MATH-500 loaders, synthetic tasks, V4 chat format)
    rollouts         the rollout half: servers, dynamic-sampling collection, weight pushes, eval sampling
    rewards, plugins answer checking; a user's own `--train.reward module:function`
    actor            the training half: old log-probs, the GRPO step over the parallel engine, weight streaming
    evaluate, live   pass@k / avg@n on held-out problems; live checks against the rollout server
    metrics, plots   one JSON line per event and the run's figures; runstats(_plots) after the run

GRPO's math itself is `nanoflash/grpo.py` (pure functions, no loop); the engine is `nanoflash/parallel/`, the
SGLang boundary `nanoflash/rollout/`. Tests: `pytest tests/test_trainer.py tests/test_train_e2e.py -q`.
"""

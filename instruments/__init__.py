"""Instruments: measurements of a run that the loop does not need, outside the product package.

    live.py           the live FP8-floor checks, a probe after every push, the warm start re-evaluated: a loop
                      hook (`--train.hooks instruments.live:LiveChecks`, nanoflash/rl/hooks.py)
    runstats.py       a run's statistics after the fact (drift, jumps, the gap over the floor); runstats_plots.py
                      their figures
    bands.py          the gap and the FP8 floor by position band (window / C4 keeping all / C4 top-k), per step and
                      over a run (issue 42)
    indexer_agreement.py  the C4 entries the indexer keeps: exact vs SGLang's FP8 scores, vs what SGLang reports
    mismatch.py       `python -m instruments.mismatch`: |dlogp| statistics and the first diverging block against a
                      server that answers /nanoflash/trace
    loader_check.py   `python -m instruments.loader_check`: the weight stream through SGLang's real loader on a CPU

nanoflash never imports this package (tests/test_layers.py keeps it so). Tests: tests/test_live_naive.py,
tests/test_rollout_mismatch.py, tests/test_rollout_loader_check.py,
experiments/h200/test_h200_pieces.py, experiments/h200/test_long.py.
"""

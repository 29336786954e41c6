"""nanoflash's own SGLang-protocol server: a stand-in for SGLang on machines without it (CPU, tests, one GPU).

    engine.py        embedded inference: sampling, incremental decode, log-probs by the trainer's own scoring
                     (true on-policy), R3 routing records, the pushed weights and their post-processing
    http.py          the HTTP layer over the engine (`python -m nanoflash.server`)
    http_guard.py    bounded bodies, keys, timeouts of the HTTP server
    update_guard.py  who may open a weight-update group or read a disk push
    trace.py         per-block activations of the served model (`/nanoflash/trace`, for instruments.mismatch)

It speaks SGLang's protocol and loads what SGLang's loader loads (`nanoflash.sglang.layout`); it never imports
the trainer or the loop. Tests: `pytest tests/test_rollout_server.py tests/test_sampling.py -q`.
"""

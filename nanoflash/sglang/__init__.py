"""Rollout: the SGLang boundary -- a client, nanoflash's own SGLang-protocol server, and FP8 weight sync.

Reading order:
    client.py       HTTP client for SGLang's protocol (generate, pause/continue, weight updates, protocol
                    generation detection, retries, several servers); cannot tell real SGLang from ours
    layout.py       the name table to SGLang's loader names and what its DeepSeek-V4 `load_weights` does with a
                    stream (fused pairs, permuted ape, int32 tid2eid) -- the layout both sides checksum
    weight_sync.py  trainer model -> (rename, FP8 128x128, byte buckets that keep atomic pairs) -> push
                    (tensor | distributed | disk) with the pause/begin/end/continue protocol and verification
    engine.py       embedded inference: sampling, incremental decode, log-probs by the trainer's own scoring
                    (true on-policy), R3 routing records, the pushed weights and their post-processing
    server.py       `python -m nanoflash.server`: the HTTP layer over the engine
    mismatch.py     `python -m instruments.mismatch`: |dlogp| statistics and the first diverging block
    loader_check.py opt-in proof against SGLang's real loader on a CPU (its own environment)

Tests: `pytest tests/test_weight_sync.py tests/test_rollout_client.py tests/test_rollout_server.py
tests/test_rollout_mismatch.py -q` (opt-in: `pytest -m sglang tests/test_rollout_loader_check.py`).
"""

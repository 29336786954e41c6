"""The SGLang boundary: everything the trainer needs to talk to SGLang servers, and only that.

Reading order:
    client.py      HTTP client for SGLang's protocol (generate, pause/continue, weight updates, protocol
                   generation detection, retries, several servers); cannot tell real SGLang from nanoflash's server
    layout.py      the name table to SGLang's loader names and what its DeepSeek-V4 `load_weights` does with a
                   stream (fused pairs, permuted ape, int32 tid2eid) -- the layout both sides checksum
    buckets.py     the storage SGLang serves (FP8 128x128 blocks, bf16 for the rest: `served_dtype`,
                   `served_storage`), atomic units packed into byte buckets, their wire encodings
    transports.py  one bucket to the servers: tensor (CUDA IPC) | local | disk | distributed (a process group
                   joined with the servers' ranks); the push protocol of one process and its verification
    push.py        `StagePusher`: every pipeline stage pushes its own slice (EP peers gathered to the stage's
                   source), verified by SGLang's own hashes -- the loop's one push path, for any world size
    probe.py       the behavioural check of a push: the servers' log-probs of fixed tokens against the trainer's
    preflight.py   before the first push: each server holds experts as the stream sends them (decided as SGLang
                   decides, from what it reports), and a distributed push's two sides run one torch / NCCL

nanoflash's own server (the stand-in) is `nanoflash/server/`; README.md here covers both.
Tests: `pytest tests/test_weight_sync.py tests/test_weight_sync_stage.py tests/test_rollout_client.py -q`.
"""

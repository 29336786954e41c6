"""Rollout: SGLang-protocol client, nanoflash's embedded rollout server, and FP8 weight sync.

Tests: `pytest tests/test_weight_sync.py tests/test_rollout_client.py tests/test_rollout_server.py -q`.
"""

"""The experiment's tests (test_h200_pieces.py, test_long.py) run on tiny models: one intra-op thread for each
module (two threads on a loaded 2-core box spin ~100x slower on such matmuls)."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

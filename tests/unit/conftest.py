"""The unit tier: in-process tests on tiny shapes, each on one torch thread (a second thread only adds
synchronisation on such shapes, and spins when the cores are shared, as under pytest-xdist)."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

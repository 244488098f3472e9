"""Parity suite: jaxamp (JAX) against torch_ref (PyTorch), all on CPU.

torch is an optional (test/extra) dependency: without it the whole directory is skipped.
"""

import pytest

pytest.importorskip("torch")


@pytest.fixture(autouse=True, scope="module")
def _torch_single_thread():
    """Run torch on one thread, then restore the setting.

    The parity nets are tiny (32 units), so torch's intra-op threads only spin against XLA's
    and each other on a 2-core machine: a torch_ref training step measured 15 ms CPU with one
    thread and 52-78 ms with two.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

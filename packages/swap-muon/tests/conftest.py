"""Test settings of swap-muon.

Newton-Schulz on the suite's small matrices is a long chain of tiny bf16 matrix
products: torch's intra-op threads cost more than they save there, and on a
busy 2-core machine their spin-waits make the suite several times slower. Both
optimizers of every parity check run in this process under the same setting.
"""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

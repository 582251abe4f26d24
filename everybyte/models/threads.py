"""Running a piece of CPU work on one torch thread (deterministic sums; steady on a busy host)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """torch (and so oneDNN, MKL and our C kernels) on one CPU thread, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)

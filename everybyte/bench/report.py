"""Every `everybyte bench ...` prints one JSON object on stdout and writes it to --json PATH."""
from __future__ import annotations

import os
import platform
import sys

from everybyte.json_output import emit  # noqa: F401  (bench commands import it from here)


def environment() -> dict:
    import torch
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }

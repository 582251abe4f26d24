"""Every `everybyte bench ...` prints one JSON object on stdout and writes it to --json PATH."""
from __future__ import annotations

import json
import os
import platform
import sys


def emit(result: dict, json_path: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=False, default=float)
    print(text)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            f.write(text + "\n")


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

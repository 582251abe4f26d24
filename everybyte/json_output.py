"""Print a result as JSON and optionally write it to a file (bench and sim commands)."""
from __future__ import annotations

import json
import os


def emit(result: dict, json_path: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=False, default=float)
    print(text)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            f.write(text + "\n")

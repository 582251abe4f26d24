"""Print a result as JSON and optionally write it to a file (bench and sim commands)."""
from __future__ import annotations

import errno
import json
import os
import tempfile


def emit(result: dict, json_path: str | None) -> None:
    text = json.dumps(result, indent=2, sort_keys=False, default=float)
    print(text)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            f.write(text + "\n")


def check_writable(*paths: str | None, directory: bool = False) -> None:
    """Fail before a long run instead of after it: for each path given (None: no output asked
    for), make the folder that will hold it (or the path itself, a directory) and write a scratch
    file there. OSError naming the path when that fails."""
    for path in paths:
        if not path:
            continue
        folder = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
        try:
            if not directory and os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "it is a directory")
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise OSError(f"cannot write {path!r}: {e.strerror or e}") from None

"""Bad trace records: an error naming the file and line, or skipped and counted with --skip-bad."""
from __future__ import annotations


class TraceError(ValueError):
    pass


class Records:
    """Collects skipped records when skip_bad, else raises on the first bad one."""

    def __init__(self, skip_bad: bool):
        self.skip_bad = skip_bad
        self.skipped: list[str] = []

    def bad(self, where: str, why: str) -> None:
        msg = f"{where}: {why}"
        if not self.skip_bad:
            raise TraceError(f"malformed trace record at {msg} (use --skip-bad to skip and count such records)")
        self.skipped.append(msg)


def need_int(rec: dict, key: str, minimum: int = 0) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise ValueError(f"{key!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def need_num(rec: dict, key: str, default: float | None = None, minimum: float = 0.0) -> float:
    v = rec.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"missing {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= minimum:
        raise ValueError(f"{key!r} must be a number >= {minimum}, got {v!r}")
    return float(v)


def need_ids(rec: dict, key: str) -> list[int]:
    v = rec.get(key)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ValueError(f"{key!r} must be a list of integers")
    return v

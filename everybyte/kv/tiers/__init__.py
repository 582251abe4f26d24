"""A tier below the device as the KV control plane sees it: the TierBackend interface (kv/tiers/base).
It imports no torch; the backends that move the bytes are KV data (kv/data/tiers/)."""
from everybyte.kv.tiers.base import TierBackend, TierStats, io_executor, job_executor

__all__ = ["TierBackend", "TierStats", "io_executor", "job_executor"]

"""`--kv-tiers`: which tiers sit below the device, how big, and how fast they load.

    host:2GiB,disk:/var/cache/eb:20GiB,redis://127.0.0.1:6379:8GiB,shared:/mnt/pod:100GiB,cold:/mnt/s3fs:1TiB

host = G2 (pinned host memory), disk = G3 (local directory), redis / shared = G3.5 (pod-shared),
cold = G4 (a shared directory used as a cold tier). Redis URLs may carry `?ttl=SECONDS&prefix=P`.
Sizes need a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB). "none" turns every tier off; the
default is a 1 GiB host tier.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import torch

from everybyte.kv.data.pool import parse_size
from everybyte.kv.data.tiers.buffers import as_uint8_tensor
from everybyte.kv.tiers.base import TierBackend

DEFAULT_KV_TIERS = "host:1GiB"
LEVELS = {"host": "G2", "disk": "G3", "redis": "G3.5", "shared": "G3.5", "cold": "G4"}
_ORDER = {"G2": 0, "G3": 1, "G3.5": 2, "G4": 3}


@dataclass
class TierSpec:
    kind: str
    capacity_bytes: int
    path: str | None = None
    url: str | None = None
    options: dict = field(default_factory=dict)

    @property
    def level(self) -> str:
        return LEVELS[self.kind]


def _size(text: str, entry: str) -> int:
    if not re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]+\s*", text):
        raise ValueError(f"--kv-tiers entry {entry!r}: size {text!r} needs a unit, e.g. 2GiB or 500MB")
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"--kv-tiers entry {entry!r}: {e}") from None


def _parse_redis(entry: str) -> TierSpec:
    url, sep, size = entry.rpartition(":")
    if not sep or "//" not in url or not size:
        raise ValueError(f"--kv-tiers entry {entry!r}: expected redis://HOST:PORT[/DB][?ttl=S&prefix=P]:SIZE")
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    options = {}
    if "ttl" in query:
        try:
            options["ttl_s"] = int(query.pop("ttl"))
        except ValueError:
            raise ValueError(f"--kv-tiers entry {entry!r}: ttl must be whole seconds") from None
    if "prefix" in query:
        options["prefix"] = query.pop("prefix")
    url = urlunsplit(parts._replace(query=urlencode(query)))
    if not parts.hostname and parts.scheme != "unix":
        raise ValueError(f"--kv-tiers entry {entry!r}: no host in {url!r}")
    return TierSpec("redis", _size(size, entry), url=url, options=options)


def parse_kv_tiers(spec: str | None = DEFAULT_KV_TIERS) -> list[TierSpec]:
    """Parse a --kv-tiers string into tier specs ordered G2 -> G4."""
    spec = DEFAULT_KV_TIERS if spec is None else spec.strip()
    if spec.lower() in ("", "none", "off"):
        return []
    out: list[TierSpec] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            raise ValueError(f"--kv-tiers {spec!r} has an empty entry")
        if re.match(r"(redis|rediss|unix)://", entry):
            ts = _parse_redis(entry)
        else:
            kind, _, rest = entry.partition(":")
            if kind not in LEVELS:
                raise ValueError(f"--kv-tiers entry {entry!r}: unknown tier {kind!r}; use host:SIZE, "
                                 "disk:PATH:SIZE, redis://HOST:PORT:SIZE, shared:PATH:SIZE or cold:PATH:SIZE")
            if kind == "host":
                if not rest or ":" in rest:
                    raise ValueError(f"--kv-tiers entry {entry!r}: expected host:SIZE")
                ts = TierSpec("host", _size(rest, entry))
            else:
                path, sep, size = rest.rpartition(":")
                if not sep or not path:
                    raise ValueError(f"--kv-tiers entry {entry!r}: expected {kind}:PATH:SIZE")
                ts = TierSpec(kind, _size(size, entry), path=os.path.expanduser(path))
        if any(t.kind == ts.kind for t in out):
            raise ValueError(f"--kv-tiers {spec!r}: tier {ts.kind!r} given twice")
        out.append(ts)
    return sorted(out, key=lambda t: _ORDER[t.level])


def build_tier(ts: TierSpec, pin_memory: bool | None = None) -> TierBackend:
    from everybyte.kv.data.tiers import DiskTier, HostTier, RedisTier, SharedDirTier
    if ts.kind == "host":
        return HostTier(ts.capacity_bytes, pin_memory=pin_memory)
    if ts.kind == "disk":
        return DiskTier(ts.path, ts.capacity_bytes)
    if ts.kind == "redis":
        return RedisTier(ts.url, ts.capacity_bytes, **ts.options)
    return SharedDirTier(ts.path, ts.capacity_bytes, level=ts.level)


def build_tiers(spec: str | list[TierSpec] | None = DEFAULT_KV_TIERS,
                pin_memory: bool | None = None) -> list[TierBackend]:
    specs = parse_kv_tiers(spec) if spec is None or isinstance(spec, str) else spec
    return [build_tier(ts, pin_memory) for ts in specs]


# ---- bandwidth ------------------------------------------------------------------------------
def measure_load_bandwidth(tier: TierBackend, block_bytes: int = 1 << 20, num_blocks: int = 8,
                           device: str | torch.device = "cpu") -> float:
    """Bytes/s to get blocks from `tier` and copy them into a `device` buffer (what loading into
    the pool costs); page caches are dropped first where possible. 0.0 when the tier fails."""
    room = max(tier.capacity_bytes - tier.used_bytes, 0) // 2
    num_blocks = max(1, min(num_blocks, room // max(block_bytes, 1)))
    block_bytes = min(block_bytes, max(room, 1))
    saved = tier.stats.to_dict()
    seed = f"everybyte-probe-{os.getpid()}-{time.time_ns()}".encode()
    names = [hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(num_blocks)]
    data = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    dst = torch.empty(block_bytes, dtype=torch.uint8, device=device)
    try:
        if not all(tier.put(n, data) for n in names):
            return 0.0
        for n in names:
            getattr(tier, "drop_page_cache", lambda _: None)(n)
        t0 = time.perf_counter()
        for n in names:
            got = tier.get(n)
            if got is None:
                return 0.0
            src = as_uint8_tensor(got)
            dst.copy_(src[:block_bytes])
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
        dt = time.perf_counter() - t0
        return num_blocks * block_bytes / max(dt, 1e-9)
    finally:
        for n in names:
            tier.delete(n)
        tier.stats.counts.update(saved)


def probe_tiers(tiers: list[TierBackend], **kw) -> dict[str, float]:
    """Load bandwidth (bytes/s) per tier kind."""
    return {t.kind: measure_load_bandwidth(t, **kw) for t in tiers}


def load_beats_recompute(load_bytes_per_s: float, bytes_per_token: int, prefill_tokens_per_s: float,
                         latency_s: float = 0.0, num_tokens: int = 1) -> bool:
    """Whether loading num_tokens of KV from a tier is faster than recomputing them."""
    if load_bytes_per_s <= 0:
        return False
    return latency_s + num_tokens * bytes_per_token / load_bytes_per_s < num_tokens / prefill_tokens_per_s

"""The KV connector: named blocks fetched from another worker, loaded as a tier's blocks are.

Disaggregated prefill/decode (vLLM's `kv_transfer_params` flow): a prefill worker computes a
prompt's KV and answers with where its blocks wait (`TransferParams`); the decode worker
registers those names with `RemoteBlocks`, one more source in the TierSet (searched after the
local tiers, before the pod-shared one), so the block loader fetches and loads them exactly as it
loads a G2/G3 block: the request waits LOADING, others keep stepping, and a block that does not
come (peer gone, timeout), comes corrupt or under another namespace is recomputed from there on.

A `KVConnector` carries blocks in their stored format (kv/data/tiers/codec.py, an NVFP4 block at
4.5 bits a value), each in the tiers' frame (magic, length, xxh3 checksum); RemoteBlocks checks
every frame and the peer's namespace digest. Implementations live in kv/data/connectors/.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

from everybyte.kv.block_id import NAME_BYTES
from everybyte.kv.tiers.base import TierBackend, log
from everybyte.kv.tiers.frame import unframe

REMOTE_LEVEL = "remote"
EXPECT_TTL_S = 120.0


class TransferRefused(Exception):
    """The peer's blocks are of another namespace (model, KV format, scales): never loaded."""


class TransferFailed(Exception):
    """No (complete) answer from the peer: its blocks are recomputed."""


@dataclass(frozen=True)
class TransferParams:
    """What a prefill worker answers: where the prompt's blocks wait and what they are."""
    remote_endpoint: str
    namespace_digest: bytes
    block_hashes: tuple[bytes, ...]
    num_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"remote_endpoint": self.remote_endpoint, "namespace_digest": self.namespace_digest.hex(),
                "block_hashes": [h.hex() for h in self.block_hashes], "num_tokens": self.num_tokens}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TransferParams":
        try:
            endpoint, digest, hashes, n = (d["remote_endpoint"], d["namespace_digest"], d["block_hashes"],
                                           d["num_tokens"])
        except KeyError as e:
            raise ValueError(f"kv_transfer_params with do_remote_prefill needs {e.args[0]!r}") from None
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"kv_transfer_params.remote_endpoint must be a URL like tcp://HOST:PORT, got {endpoint!r}")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise ValueError("kv_transfer_params.block_hashes must be a list of hex strings")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"kv_transfer_params.num_tokens must be an int >= 0, got {n!r}")
        try:
            names = tuple(bytes.fromhex(h) for h in hashes)
            ns = bytes.fromhex(digest) if isinstance(digest, str) else b""
        except ValueError:
            raise ValueError("kv_transfer_params: block_hashes and namespace_digest must be hex") from None
        if len(ns) != NAME_BYTES or any(len(h) != NAME_BYTES for h in names):
            raise ValueError(f"kv_transfer_params: namespace_digest and block_hashes are {NAME_BYTES}-byte hex")
        return cls(endpoint, ns, names, n)


def transfer_kind(d: dict[str, Any] | None) -> str | None:
    """"decode" (the request's KV goes to a decode worker: do_remote_decode), "prefill" (its
    prefill was done remotely: do_remote_prefill) or None; a clear ValueError for a bad field."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError("kv_transfer_params must be an object")
    decode, prefill = bool(d.get("do_remote_decode")), bool(d.get("do_remote_prefill"))
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
    if prefill:
        TransferParams.from_json(d)
        return "prefill"
    return "decode" if decode else None


class KVConnector(Protocol):
    path: str                  # "zmq", "nixl": the counters' label

    def fetch(self, endpoint: str, digest: bytes, names: list[bytes]) -> list[Any]:
        """One framed block (bytes-like) per name, or None for a block the peer does not hold.
        Raises TransferRefused when the peer's namespace differs, TransferFailed on no answer."""


class PathStats:
    FIELDS = ("fetches", "blocks_received", "bytes_received", "missing", "corrupt", "failed", "refused",
              "seconds")

    def __init__(self) -> None:
        self.counts: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def add(self, key: str, n: float = 1) -> None:
        self.counts[key] += n


class RemoteBlocks(TierBackend):
    """Blocks another worker holds for this one's requests, by name -> (connector, endpoint)."""
    kind = "connector"

    def __init__(self, connectors: dict[str, KVConnector], digest: bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(1, REMOTE_LEVEL)
        self.capacity_bytes = 0                        # holds nothing itself
        self.connectors, self.digest, self.clock = connectors, digest, clock
        self._lock = threading.Lock()
        self._where: OrderedDict[bytes, tuple[str, float]] = OrderedDict()   # name -> (endpoint, expiry), by expiry
        self.paths: dict[str, PathStats] = {}
        self.refused = 0

    def connector_for(self, endpoint: str) -> KVConnector:
        scheme = endpoint.split("://", 1)[0]
        if scheme not in self.connectors:
            raise ValueError(f"no KV connector for {endpoint!r}; known: {', '.join(self.connectors)}")
        return self.connectors[scheme]

    def expect(self, params: TransferParams) -> int:
        """Make the named blocks loadable from params.remote_endpoint; refused (counted, and
        TransferRefused raised) when the peer's namespace is not this worker's."""
        path = self._path(self.connector_for(params.remote_endpoint).path)
        if params.namespace_digest != self.digest:
            path.add("refused")
            self.refused += 1
            raise TransferRefused(f"peer namespace {params.namespace_digest.hex()[:12]} is not this worker's "
                                  f"{self.digest.hex()[:12]} (other model, KV format or scales)")
        with self._lock:
            now = self.clock()
            where, until = self._where, now + EXPECT_TTL_S
            while where:                       # the expired, oldest first (a full scan per call was
                name, (_, t) = next(iter(where.items()))      # quadratic in the blocks expected)
                if t >= now:
                    break
                del where[name]
            for name in params.block_hashes:
                where[name] = (params.remote_endpoint, until)
                where.move_to_end(name)        # kept in expiry order
        return len(params.block_hashes)

    def _path(self, name: str) -> PathStats:
        return self.paths.setdefault(name, PathStats())

    # ---- the tier interface ------------------------------------------------------------------
    def contains(self, name: bytes) -> bool:
        with self._lock:
            hit = self._where.get(name)
        return hit is not None and hit[1] >= self.clock()

    def contains_many(self, names: Iterable[bytes]) -> list[bool]:
        """contains() of each name, under one lock and one clock reading."""
        with self._lock:
            where, now = self._where, self.clock()
            return [(hit := where.get(n)) is not None and hit[1] >= now for n in names]

    def get(self, name: bytes) -> Any:
        return next(self.get_stream([name]))[0][1]

    def get_stream(self, names: list[bytes], scratch: Any = None) -> Iterator[list[tuple[int, Any]]]:
        """One fetch per peer; every frame is checked (a corrupt or missing one is None). The
        names are forgotten once asked for: a block is fetched once."""
        by_peer: dict[str, list[int]] = {}
        with self._lock:
            for i, name in enumerate(names):
                endpoint, _ = self._where.pop(name, ("", 0.0))
                by_peer.setdefault(endpoint, []).append(i)
        for endpoint, idx in by_peer.items():
            yield list(zip(idx, self._fetch(endpoint, [names[i] for i in idx])))

    def _fetch(self, endpoint: str, names: list[bytes]) -> list[Any]:
        if not endpoint:
            self.stats.add("misses", len(names))
            return [None] * len(names)
        conn = self.connector_for(endpoint)
        path, t0 = self._path(conn.path), time.perf_counter()
        path.add("fetches")
        try:
            frames = conn.fetch(endpoint, self.digest, names)
        except TransferRefused as e:
            path.add("refused")
            self.refused += 1
            log.warning("KV transfer from %s refused: %s; recomputing", endpoint, e)
            frames = [None] * len(names)
        except (TransferFailed, OSError) as e:
            path.add("failed")
            self.stats.add("errors")
            log.warning("KV transfer from %s failed: %s; recomputing", endpoint, e)
            frames = [None] * len(names)
        path.add("seconds", time.perf_counter() - t0)
        out = []
        for name, frame in zip(names, frames):
            payload = None if frame is None else unframe(frame)
            if frame is not None:
                path.add("bytes_received", len(memoryview(frame)))
                self.stats.add("bytes_read", len(memoryview(frame)))
            if frame is None:
                path.add("missing")
            elif payload is None:
                path.add("corrupt")
                self.stats.add("corrupt")
                log.warning("KV block %s from %s failed its checksum; recomputing", name.hex()[:12], endpoint)
            else:
                path.add("blocks_received")
            self.stats.add("hits" if payload is not None else "misses")
            out.append(payload)
        return out

    def put(self, name: bytes, data: Any) -> bool:
        self.stats.add("rejected")
        return False                                   # never a write target

    def delete(self, name: bytes) -> bool:
        with self._lock:
            return self._where.pop(name, None) is not None

    @property
    def used_bytes(self) -> int:
        return 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "refused": self.refused,
                "paths": {k: dict(v.counts) for k, v in self.paths.items()}}

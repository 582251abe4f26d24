"""Disaggregated prefill/decode in one engine: `kv_transfer_params` on requests and outputs.

role "prefill" (or "both" with a connector endpoint) runs a BlockServer: a request with
{"do_remote_decode": true} computes its prompt, and when it finishes the prompt's full blocks
are encoded from G1 in their stored format, framed and staged on the server (until fetched or
60 s), the pod-shared tier's write-through is waited for, and the output carries the
TransferParams a decode worker needs. role "decode" (or "both") takes {"do_remote_prefill": true,
...those params...}: the named blocks become loadable from the peer (kv/connector.RemoteBlocks),
so the request loads them like any tier's blocks and computes only what is missing.
"""
from __future__ import annotations

import logging

from everybyte.kv.block_id import chain_block_ids
from everybyte.kv.connector import RemoteBlocks, TransferParams, TransferRefused, transfer_kind
from everybyte.kv.data.tiers.buffers import as_bytes_view
from everybyte.kv.memory_manager import KVMemoryManager
from everybyte.kv.tiers.frame import frame_header

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")


class KVTransfer:
    def __init__(self, memory: KVMemoryManager, role: str = "both", bind: str | None = None,
                 timeout_s: float = 5.0, ttl_s: float = 60.0):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        if bind and role == "decode":
            raise ValueError("a KV connector endpoint serves a prefill's blocks: not with role decode")
        self.memory, self.role, self.timeout_s = memory, role, timeout_s
        self.server = None
        if role == "prefill" or (bind and role == "both"):
            from everybyte.kv.data.connectors.zmq_server import BlockServer
            self.server = BlockServer(memory.ns.digest, bind or "tcp://127.0.0.1:0", ttl_s)
        self.remote: RemoteBlocks | None = None

    @property
    def endpoint(self) -> str | None:
        return None if self.server is None else self.server.endpoint

    def admit(self, seq, params: dict | None) -> None:
        """Check a request's kv_transfer_params (ValueError for what this worker cannot do) and
        prepare it: mark a prefill for publishing, or make a decode's blocks loadable."""
        kind = transfer_kind(params)
        if kind is None:
            return
        assert params is not None
        if kind == "decode":
            if self.server is None:
                raise ValueError(f"do_remote_decode needs a KV connector: this worker's role is {self.role} "
                                 "(serve --role prefill, or --kv-connector tcp://HOST:PORT)")
            seq.kv_transfer = "publish"
            return
        if self.role == "prefill":
            raise ValueError("do_remote_prefill: this worker's role is prefill")
        tp = TransferParams.from_json(params)
        try:
            n = self._remote().expect(tp)
        except TransferRefused as e:
            log.warning("KV transfer refused: %s; recomputing", e)
            return
        log.debug("request %s: %d blocks to fetch from %s", seq.request_id, n, tp.remote_endpoint)

    def _remote(self) -> RemoteBlocks:
        if self.remote is None:
            from everybyte.kv.data.connectors.zmq_client import ZmqConnector
            self.remote = RemoteBlocks({"tcp": ZmqConnector(self.timeout_s)}, self.memory.ns.digest)
            self.memory.tiers.add_remote(self.remote)
            self.memory.ledger.add_tier(self.remote)
        return self.remote

    def on_finish(self, seq) -> None:
        """EngineCore's hook, right after a request finished (its blocks are still in G1)."""
        if getattr(seq, "kv_transfer", None) != "publish" or seq.finish_reason == "abort" or self.server is None:
            return
        m, bs = self.memory, self.memory.block_size
        ns = m.ns.with_tenant(seq.cache_salt) if seq.cache_salt else m.ns
        names = chain_block_ids(ns, seq.prompt_token_ids[:seq.num_prompt_tokens // bs * bs], bs)
        ids = []
        for name in names:
            block = m.cache.block_of(name)
            if block is None:
                break
            ids.append(block)
        names = names[:len(ids)]
        if ids:
            rows = m.mover.store(ids, names)
            frames = []
            for i in range(len(ids)):
                payload = as_bytes_view(rows[i])
                frames.append(frame_header(payload) + payload.tobytes())
            self.server.offer(names, frames)
        if m.tiers.write_through:
            m.tiers.flush()                 # the pod-shared tier holds them before the answer goes out
        tp = TransferParams(self.server.endpoint, m.ns.digest, tuple(names), len(names) * bs)
        seq.kv_transfer_params = tp.to_json()

    def stats(self) -> dict:
        out: dict = {"role": self.role, "endpoint": self.endpoint}
        if self.server is not None:
            out["served"] = {**self.server.stats, "staged_now": len(self.server)}
        paths: dict = {}
        if self.remote is not None:
            d = self.remote.describe()
            paths.update(d["paths"])
            out["refused"] = d["refused"]
        for t in self.memory.tiers.write_through:
            s = t.stats.to_dict()
            paths[t.kind] = {"bytes_received": s["bytes_read"], "blocks_received": s["hits"]}
        out["paths"] = paths
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

"""KV events on the wire: vLLM's KVEventBatch as msgpack (msgspec, array-like tagged structs), so
tools written for vLLM's `--kv-events-config` stream read ours, and ours read theirs.

A batch is [ts, events, data_parallel_rank]; an event is ["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium], ["BlockRemoved", block_hashes,
medium] or ["AllBlocksCleared"]. The structs below mirror vllm.distributed.kv_events; the class
names are the tags. encode/decode convert from and to kv/events' dataclasses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Union

import msgspec

from everybyte.kv import events as ev

# the replay socket's last frame: "no more events after this" (sequence number -1)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BlockHash = Union[bytes, int]          # vLLM's ExternalBlockHash; ours are 16-byte names


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: Union[BlockHash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: Union[str, None]


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


@dataclass
class WireBatch:
    """A decoded batch: when the worker made it, and its events as kv/events dataclasses."""
    ts: float
    events: list[ev.KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def _to_wire(e: ev.KVEvent) -> _Event:
    if isinstance(e, ev.BlockStored):
        return BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                           e.lora_id, e.medium)
    if isinstance(e, ev.BlockRemoved):
        return BlockRemoved(list(e.block_hashes), e.medium)
    return AllBlocksCleared()


def _from_wire(e: _Event) -> ev.KVEvent:
    if isinstance(e, BlockStored):
        parent = e.parent_block_hash
        return ev.BlockStored([_as_bytes(h) for h in e.block_hashes], e.block_size,
                              None if parent is None else _as_bytes(parent), e.medium or "G1",
                              list(e.token_ids), e.lora_id)
    if isinstance(e, BlockRemoved):
        return ev.BlockRemoved([_as_bytes(h) for h in e.block_hashes], e.medium or "G1")
    return ev.AllBlocksCleared()


def _as_bytes(h: BlockHash) -> bytes:
    """vLLM may send integer hashes; they become 8-byte big-endian names (never equal to ours)."""
    return h if isinstance(h, bytes) else h.to_bytes(8, "big", signed=h < 0)


def encode_batch(events: list[ev.KVEvent], ts: float | None = None, data_parallel_rank: int | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, [_to_wire(e) for e in events],
                                        data_parallel_rank))


def decode_batch(payload: bytes) -> WireBatch:
    """A payload back into kv/events dataclasses; msgspec.ValidationError/DecodeError when it is
    not a KVEventBatch."""
    b = _decoder.decode(payload)
    return WireBatch(b.ts, [_from_wire(e) for e in b.events], b.data_parallel_rank)

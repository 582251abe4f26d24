"""Content names for KV blocks.

A full block is named by blake2b-128 over (namespace digest, parent block's name, the block's token
ids packed as little-endian int32: every vocabulary fits, and a 16-token block with its prefix then
fills one 128-byte BLAKE2b block, one compression instead of two). The namespace covers everything
that changes a block's bytes, so the same name means the same bytes in every process, tier and
node; no seeds, no Python `hash`.
Partial blocks are never named: their bytes change as tokens arrive.
A namespace with name_hash="mix128" names its blocks with kv/block_mix instead: faster, not
collision-resistant, for the simulator only.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Final, Protocol, Sequence

from everybyte.kv.block_mix import mix_name
from everybyte.native import loader

NAME_BYTES: Final = 16
ROOT_PARENT: Final = b"\x00" * NAME_BYTES
_DOMAIN: Final = b"everybyte-kv-block-v2"           # v2: int32 tokens (v1 packed int64)


_PERSON: Final = b"everybyte.kv"
NAME_HASHES = ("blake2b", "mix128")         # mix128: simulated fleets only (kv/block_mix)


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=NAME_BYTES, person=_PERSON)
    for p in parts:
        h.update(p)
    return h.digest()


class PoolLike(Protocol):
    """What `KVNamespace.for_pool` reads of a KVPool."""
    kv_cache_dtype: str
    block_size: int
    layer_shapes: list[tuple[int, int]]
    k_scales: list[float]
    v_scales: list[float]


@dataclass(frozen=True)
class KVNamespace:
    """Everything besides tokens that decides a block's bytes.

    `kv_fingerprint` covers the pool's layer shapes and per-layer K/V scales (see `for_pool`);
    `layer_shard` names which layers this rank holds ("all", "pp0/4", "0-14"); `tenant_salt`
    keeps tenants from ever sharing a block; `name_hash` is "blake2b" (the engine's) or "mix128"
    (the simulator's: see kv/block_mix).
    """
    model_id: str
    revision: str = ""
    kv_format: str = "fp16"
    block_size: int = 16
    layer_shard: str = "all"
    tenant_salt: str | bytes | None = None
    kv_fingerprint: str = ""
    name_hash: str = "blake2b"
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.name_hash not in NAME_HASHES:
            raise ValueError(f"name_hash must be one of {', '.join(NAME_HASHES)}, got {self.name_hash!r}")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if self.name_hash == "blake2b":
            del d["name_hash"]                # the digests of namespaces from before the field
        salt = self.tenant_salt
        d["tenant_salt"] = None if salt is None else (salt.encode() if isinstance(salt, str) else bytes(salt)).hex()
        canon = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "digest", _h(_DOMAIN, b"ns", canon))

    def with_tenant(self, tenant_salt: str | bytes | None) -> "KVNamespace":
        return KVNamespace(self.model_id, self.revision, self.kv_format, self.block_size,
                           self.layer_shard, tenant_salt, self.kv_fingerprint, self.name_hash)

    @classmethod
    def for_pool(cls, pool: PoolLike, model_id: str, revision: str = "", layer_shard: str = "all",
                 tenant_salt: str | bytes | None = None) -> "KVNamespace":
        """A namespace for a KVPool (anything with kv_cache_dtype, block_size, layer_shapes,
        k_scales and v_scales): the fingerprint changes when shapes or scales do."""
        fp = json.dumps({"shapes": [list(s) for s in pool.layer_shapes],
                         "k_scales": [float(s).hex() for s in pool.k_scales],
                         "v_scales": [float(s).hex() for s in pool.v_scales]}, sort_keys=True)
        return cls(model_id, revision, pool.kv_cache_dtype, pool.block_size, layer_shard,
                   tenant_salt, _h(fp.encode()).hex())


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian int32 ids; struct.error names a token that is not an int in [-2**31, 2**31)."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


_BLOCK_HASHERS: Final[dict[bytes, Any]] = {}


def _block_hasher(namespace: KVNamespace) -> Any:
    """A blake2b already fed the domain and namespace digest (copied per block: same bytes as _h)."""
    h = _BLOCK_HASHERS.get(namespace.digest)
    if h is None:
        if len(_BLOCK_HASHERS) >= 4096:       # one per namespace digest, and tenant salts make many
            _BLOCK_HASHERS.clear()
        h = hashlib.blake2b(digest_size=NAME_BYTES, person=_PERSON)
        h.update(_DOMAIN)
        h.update(namespace.digest)
        _BLOCK_HASHERS[namespace.digest] = h
    return h


def block_id(namespace: KVNamespace, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The name of one full block whose predecessor is named `parent` (None for the first)."""
    if len(token_ids) != namespace.block_size:
        raise ValueError(f"only full blocks are named: got {len(token_ids)} tokens, "
                         f"block size {namespace.block_size}")
    parent = ROOT_PARENT if parent is None else parent
    if len(parent) != NAME_BYTES:
        raise ValueError(f"parent name must be {NAME_BYTES} bytes, got {len(parent)}")
    if namespace.name_hash == "mix128":
        return mix_name(namespace.digest, parent, pack_tokens(token_ids))
    return _h(_DOMAIN, namespace.digest, parent, pack_tokens(token_ids))


def chain_block_ids(namespace: KVNamespace, token_ids: Sequence[int], block_size: int | None = None,
                    *, parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """Names of the full blocks of `token_ids` from block `start_block` on; `parent` is the name of
    block start_block-1 (None when start_block == 0). The trailing partial block gets no name."""
    bs = namespace.block_size if block_size is None else block_size
    if bs != namespace.block_size:
        raise ValueError(f"block_size {bs} differs from the namespace's {namespace.block_size}")
    if start_block > 0 and parent is None:
        raise ValueError("start_block > 0 needs the parent name of block start_block-1")
    name = ROOT_PARENT if parent is None else parent
    if len(name) != NAME_BYTES:
        raise ValueError(f"parent name must be {NAME_BYTES} bytes, got {len(name)}")
    end = len(token_ids) // bs
    if end <= start_block:
        return []
    compiled = compiled_names()
    if compiled is not None:
        try:
            names: list[bytes]
            if namespace.name_hash == "mix128":
                names = compiled.chain_mix(namespace.digest, name, token_ids, start_block * bs, end * bs, bs)
            else:
                names = compiled.chain(_DOMAIN + namespace.digest, name, token_ids, start_block * bs, end * bs,
                                       bs, _PERSON)
            return names
        except (OverflowError, TypeError):
            pass                            # not an int32 token: struct.pack below says which
    return _chain_hashlib(namespace, token_ids, bs, name, start_block, end)


def _chain_hashlib(namespace: KVNamespace, token_ids: Sequence[int], bs: int, name: bytes, start_block: int,
                   end: int) -> list[bytes]:
    """chain_block_ids with hashlib (or kv/block_mix): the reference the compiled names are tested
    against."""
    names: list[bytes] = []
    packed = memoryview(pack_tokens(token_ids[start_block * bs:end * bs]))   # one pack; a block is 4 * bs bytes
    step = 4 * bs
    if namespace.name_hash == "mix128":
        for off in range(0, len(packed), step):
            name = mix_name(namespace.digest, name, bytes(packed[off:off + step]))
            names.append(name)
        return names
    base = _block_hasher(namespace)
    for off in range(0, len(packed), step):
        h = base.copy()                     # block_id's bytes, without re-hashing the fixed prefix
        h.update(name)
        h.update(packed[off:off + step])
        name = h.digest()
        names.append(name)
    return names


@functools.cache
def compiled_names() -> Any:
    """csrc/block_names.c, or None (one warning) when it does not build or EVERYBYTE_NATIVE_NAMES=0:
    hashlib then."""
    if os.environ.get("EVERYBYTE_NATIVE_NAMES", "1") == "0":
        return None
    return loader.try_module("block_names", "compiled block names", "hashlib", headers=("name_hash.h",))[0]


def name_hex(name: bytes) -> str:
    return name.hex()


def name_from_hex(s: str) -> bytes:
    b = bytes.fromhex(s)
    if len(b) != NAME_BYTES:
        raise ValueError(f"block name must be {NAME_BYTES} bytes, got {len(b)}")
    return b

"""mix128 block names: a fast 128-bit name for the simulator (KVNamespace(name_hash="mix128")).

Not collision-resistant: input chosen to collide can collide, so it is for simulated fleets only,
never where a tenant's prompt could be made to name another's block (the engine names blocks
with BLAKE2b, kv/block_id). Against ordinary token streams two independent lanes of MurmurHash3's
finalizer keep accidental collisions near 2**-128, at about a tenth of a BLAKE2b compression.

A block's name: lanes a, b start from the namespace digest, then absorb the 64-bit little-endian
words of parent || the block's tokens as int32 (an odd count ends with a zero-extended 32-bit
word), a = fmix(a ^ w), b = fmix(b + w); the two are folded with the byte length.
native/csrc/block_names.c (chain_mix) computes the same; this is its reference.
"""
from __future__ import annotations

import struct

M64 = (1 << 64) - 1
MIX_A, MIX_B = 0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def _rotl(x: int, n: int) -> int:
    return ((x << n) | (x >> (64 - n))) & M64


def mix_name(digest: bytes, parent: bytes, packed: bytes) -> bytes:
    """One block's mix128 name: the namespace digest (16 bytes), the parent's name (16 bytes) and
    the block's tokens packed as little-endian int32."""
    a, b = struct.unpack("<QQ", digest)
    a, b = a ^ MIX_A, b ^ MIX_B
    data = parent + packed
    words = list(struct.unpack_from(f"<{len(data) // 8}Q", data))
    if len(data) % 8:
        words.append(struct.unpack_from("<I", data, len(data) - 4)[0])
    for w in words:
        a, b = fmix64(a ^ w), fmix64((b + w) & M64)
    n = len(packed)
    lo = fmix64(a ^ _rotl(b, 29) ^ n)
    hi = fmix64(b ^ _rotl(a, 17) ^ ((n * MIX_A) & M64))
    return struct.pack("<QQ", lo, hi)
